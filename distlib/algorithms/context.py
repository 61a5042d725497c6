"""``OpContext``: one collective's view of the mesh, and the array helpers algorithms share.

An algorithm sends and receives numbered steps of one operation; the context stamps every
frame with the group's operation number, the collective's code, dtype and reduce op, so that
the receiver can tell a frame of this operation from any other and check it matches.
"""

from __future__ import annotations

import os
from typing import List, Tuple

import numpy as np

from ..deadline import Deadline
from ..transport import frames
from ..transport.tcp import Mesh, Slot

#: Payload of one pipelined piece: big enough to amortise per-frame costs, small enough that
#: reducing one piece overlaps with receiving the next.
PIPE_BYTES = int(os.environ.get("DISTLIB_PIPE_KB", "1024")) << 10

#: Step numbers: algorithm phase * STEP_STRIDE + piece.
STEP_STRIDE = 1 << 16


class OpContext:
    __slots__ = ("mesh", "rank", "size", "seq", "op", "dtype", "redop", "count", "deadline", "what")

    def __init__(self, mesh: Mesh, seq: int, op_name: str, dtype: int, redop: int, count: int,
                 deadline: Deadline, what: str):
        self.mesh = mesh
        self.rank = mesh.rank
        self.size = mesh.size
        self.seq = seq
        self.op = frames.OPS[op_name]
        self.dtype = dtype
        self.redop = redop
        self.count = count
        self.deadline = deadline
        self.what = what

    def send(self, peer: int, view: memoryview, step: int) -> None:
        header = frames.pack(frames.DATA, self.op, self.dtype, self.redop, self.seq, step, self.count, view.nbytes)
        self.mesh.send(peer, header, view, self.deadline, self.what)

    def post(self, peer: int, view: memoryview, step: int) -> Slot:
        return self.mesh.post_data(peer, self.seq, step, view, self.op, self.dtype, self.redop, self.count,
                                   f"{self.what} (step {step})")

    def wait(self, slot: Slot) -> int:
        return self.mesh.wait(slot, self.deadline)


def bview(array: np.ndarray) -> memoryview:
    """Byte memoryview of a contiguous array (no copy)."""
    flat = array.reshape(-1)
    return memoryview(flat.view(np.uint8)) if flat.size else memoryview(bytearray(0))


def chunk_bounds(count: int, parts: int) -> List[Tuple[int, int]]:
    """Split ``count`` elements into ``parts`` contiguous ranges, the first ones one longer."""
    base, extra = divmod(count, parts)
    bounds, start = [], 0
    for i in range(parts):
        end = start + base + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def pieces(start: int, end: int, itemsize: int) -> List[Tuple[int, int]]:
    """Sub-ranges of [start, end) of about PIPE_BYTES each (at least one, possibly empty)."""
    step = max(1, PIPE_BYTES // max(1, itemsize))
    if end - start <= step:
        return [(start, end)]
    return [(lo, min(lo + step, end)) for lo in range(start, end, step)]
