"""Point-to-point messages and ``monitored_barrier``: algorithms over the mesh, as the
collectives are, so that only the operation context (context.py) and the transport know the
frame layout.

A point-to-point message is one P2P frame whose ``seq`` field carries the tag (matched first
in, first out per peer and tag: transport/matching.py). monitored_barrier is rank 0 waiting
for every other rank's arrival, each within what is left of ``timeout``, and then telling
each rank that came whether all did.
"""

from __future__ import annotations

from typing import List, Optional

import numpy as np

from ....deadline import Deadline
from ....errors import DistBackendError
from ...monitored_barrier import not_passed, told_failed
from ..transport import frames
from ..transport.matching import Slot
from ..transport.tcp import ANY_SOURCE, Mesh
from .context import OpContext, bview

#: monitored_barrier's steps: every rank's arrival (to rank 0), rank 0's verdict (to each).
ARRIVE, RELEASE = 0, 1
#: How much longer than ``timeout`` a rank waits for rank 0's verdict (rank 0 may use all of
#: ``timeout`` on a rank that does not come, then send).
VERDICT_GRACE_S = 5.0


def send(mesh: Mesh, array: np.ndarray, dtype: int, dst: int, tag: int, deadline: Deadline, what: str) -> None:
    """Send ``array`` to ``dst`` with ``tag`` (``dtype``: its code, arrays.dtype_code)."""
    view = bview(array)
    header = frames.pack(frames.P2P, frames.OPS["send"], dtype, 0, tag, 0, array.size, view.nbytes)
    mesh.send(dst, header, view, deadline, what)


def post_recv(mesh: Mesh, array: np.ndarray, dtype: int, src: Optional[int], tag: int, what: str) -> Slot:
    """Post the receive of a message with ``tag`` from ``src`` (None: any rank) into ``array``."""
    return mesh.post_p2p(ANY_SOURCE if src is None else src, tag, bview(array), dtype, array.size, what)


def monitored_barrier(ctx: OpContext, timeout_s: float, wait_all_ranks: bool) -> None:
    """Rank 0 waits up to ``timeout_s`` for each rank, then names those that did not come
    (the first one, or with ``wait_all_ranks`` all of them); the others learn from rank 0
    whether everyone came."""
    status = bytearray(1)
    if ctx.rank != 0:
        ctx.send(0, memoryview(bytearray(0)), ARRIVE)
        slot = ctx.post(0, memoryview(status), RELEASE)
        ctx.wait(slot, Deadline(timeout_s + VERDICT_GRACE_S))
        if status[0]:
            raise told_failed(timeout_s)
        return
    limit = Deadline(timeout_s)
    slots = {r: ctx.post(r, memoryview(bytearray(0)), ARRIVE) for r in range(1, ctx.size)}
    failed: List[int] = []
    for r, slot in slots.items():
        if not ctx.try_wait(slot, limit):
            failed.append(r)
            if not wait_all_ranks:
                break
    status[0] = 1 if failed else 0
    for r in range(1, ctx.size):
        if r not in failed:
            try:
                ctx.send(r, memoryview(status), RELEASE)
            except DistBackendError:
                pass
    if failed:
        raise not_passed(failed, timeout_s, wait_all_ranks)
