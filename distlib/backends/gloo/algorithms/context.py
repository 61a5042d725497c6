"""``OpContext``: one collective's view of the mesh, and the array helpers algorithms share.

An algorithm sends and receives numbered steps of one operation; the context stamps every
frame with the group's operation number, the collective's code, dtype and reduce op, so that
the receiver can tell a frame of this operation from any other and check it matches.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, List, Optional, Tuple, Union

import numpy as np

from ....deadline import Deadline
from ..transport import frames
from ..transport.tcp import Mesh, Slot

#: Payload of one pipelined piece: big enough to amortise per-frame costs (4 MiB measured best
#: for 64 MiB all_reduce over TCP at 2 and 4 ranks on 2 cores), small enough that
#: reducing one piece overlaps with receiving the next.
PIPE_BYTES = 4096 << 10

#: Step numbers: algorithm phase * STEP_STRIDE + piece.
STEP_STRIDE = 1 << 16

#: At most this many bytes of receive buffers kept per mesh between operations (ScratchPool).
SCRATCH_LIMIT = 256 << 20


class ScratchPool:
    """One receive buffer per mesh, kept between operations.

    Why: the ring posts receives several steps ahead (reduce.ring), each into its own part
    of a scratch buffer. A fresh buffer per operation costs the kernel a page fault per 4 KiB
    on first touch (as much CPU as the data's own copy); a kept one costs nothing. Operations
    on one mesh run one at a time (the group's ordered executor); an operation that finds
    the buffer taken anyway gets a fresh one.
    """

    _pools: "weakref.WeakKeyDictionary[Mesh, ScratchPool]" = weakref.WeakKeyDictionary()
    _lock = threading.Lock()

    def __init__(self):
        self.buffer = np.empty(0, np.uint8)
        self.taken = False

    @classmethod
    def of(cls, mesh: Mesh) -> "ScratchPool":
        with cls._lock:
            pool = cls._pools.get(mesh)
            if pool is None:
                pool = cls._pools[mesh] = cls()
            return pool

    def take(self, nbytes: int) -> np.ndarray:
        """``nbytes`` of scratch (uint8); give it back with release()."""
        with self._lock:
            if self.taken or nbytes > SCRATCH_LIMIT:
                return np.empty(nbytes, np.uint8)
            self.taken = True
            if self.buffer.size < nbytes:
                self.buffer = np.empty(nbytes, np.uint8)
            return self.buffer[:nbytes]

    def release(self, array: np.ndarray) -> None:
        if array.base is self.buffer or array is self.buffer:
            with self._lock:
                self.taken = False


class Label:
    """What an operation (or one step of it) is, for errors and heartbeats: ``fmt`` and its
    arguments, formatted only when shown (formatting a dtype costs about a microsecond, a
    sizeable part of a small collective)."""

    __slots__ = ("fmt", "args")

    def __init__(self, fmt: str, *args: Any):
        self.fmt = fmt
        self.args = args

    def __str__(self) -> str:
        return self.fmt.format(*self.args)

    def __repr__(self) -> str:
        return repr(str(self))


class OpContext:
    __slots__ = ("mesh", "rank", "size", "seq", "op", "dtype", "redop", "count", "deadline", "what")

    def __init__(self, mesh: Mesh, seq: int, op_name: str, dtype: int, redop: int, count: int,
                 deadline: Deadline, what: Union[str, Label]):
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
                                   Label("{} (step {})", self.what, step))

    def wait(self, slot: Slot, deadline: Optional[Deadline] = None) -> int:
        """The sender of ``slot``'s frame, once it came (by ``deadline``, else the operation's)."""
        return self.mesh.wait(slot, deadline or self.deadline)

    def try_wait(self, slot: Slot, deadline: Deadline) -> bool:
        """Whether ``slot``'s frame came by ``deadline`` (if not, the receive is withdrawn and
        the group goes on: Mesh.try_wait)."""
        return self.mesh.try_wait(slot, deadline)


def bview(array: np.ndarray) -> memoryview:
    """Byte memoryview of a contiguous array (no copy)."""
    flat = array.reshape(-1)
    # an ndarray is a buffer: numpy's stubs declare it (PEP 688) for Python >= 3.12 only
    return memoryview(flat.view(np.uint8)) if flat.size else memoryview(bytearray(0))  # type: ignore[arg-type]  # see above


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
