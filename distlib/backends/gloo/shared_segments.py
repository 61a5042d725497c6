"""How the ranks of a group agree on a shared-memory segment: all of them map it, or none.

Rank 0 creates the segment and broadcasts its name over the mesh; the others map it; a
vote (a reduce of MIN over "mapped it" to rank 0, whose verdict it broadcasts) tells
everyone whether all did. Only then does rank 0 unlink the name (every rank holds a mapping, so the memory lives exactly as long as
the group and a crash leaves nothing in /dev/shm). If anyone failed — /dev/shm full (Docker
gives containers 64 MiB), a rank that cannot open it — every rank gets None and the group
goes over TCP, with a warning that says why.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

import numpy as np

from ...errors import DistBackendError
from ...reduce_op import ReduceOp
from .algorithms import gather as gather_algos
from .algorithms import reduce as reduce_algos
from .algorithms.context import OpContext
from .algorithms.shm_allreduce import ShmAllReduce
from .transport.shm import SharedSegment, free_bytes

log = logging.getLogger("distlib.backends.gloo")

#: ``make_ctx(op_name, array, reduce_op, what)``: the next operation's context (the caller's
#: operation numbering: every rank makes the same calls in the same order).
ContextFactory = Callable[..., OpContext]


def agree_on_segment(make_ctx: ContextFactory, rank: int, nbytes: int, purpose: str,
                     label: str, prefix: str = "distlib") -> Optional[SharedSegment]:
    """Collective: a segment of ``nbytes`` mapped by every rank of the group, or None on all."""
    name = bytearray(64)
    segment = None
    problem = ""
    if rank == 0:
        if free_bytes() < nbytes:
            problem = f"/dev/shm has {free_bytes() >> 20} MiB free, {max(1, nbytes >> 20)} MiB needed"
        else:
            try:
                segment = SharedSegment.create(nbytes, prefix)
                name[: len(segment.name)] = segment.name.encode()
            except (OSError, DistBackendError) as exc:
                problem = str(exc)
    # (each context is made right before its operation: making one starts the operation)
    gather_algos.broadcast(make_ctx("broadcast", None, None, f"shared-memory setup ({purpose})"),
                           np.frombuffer(name, dtype=np.uint8), 0)
    if rank != 0 and name[0]:
        try:
            segment = SharedSegment.attach(bytes(name).rstrip(b"\0").decode(), nbytes)
        except (OSError, DistBackendError) as exc:
            problem = str(exc)
    # The vote: everyone tells rank 0, rank 0 tells everyone: 2(n-1) frames (an all_reduce's
    # direct exchange would be n(n-1): 992 at 32 ranks, all of them run by one machine).
    ok = np.array([1 if segment is not None else 0], dtype=np.int8)
    reduce_algos.direct_reduce(make_ctx("reduce", ok, ReduceOp.MIN, f"shared-memory setup vote ({purpose})"),
                               ok, 0, ReduceOp.MIN)
    gather_algos.broadcast(make_ctx("broadcast", ok, None, f"shared-memory setup verdict ({purpose})"), ok, 0)
    if segment is not None and rank == 0:
        segment.unlink()  # every rank has it mapped (the vote came from all): the name is no longer needed
    if ok[0] == 1:
        return segment
    if segment is not None:
        segment.close()
    log.warning("%s: rank %d: shared memory unavailable for %s (%s); it goes over TCP", label, rank, purpose,
                problem or "another rank could not map the segment")
    return None


class LargeSegment:
    """The large all_reduce's shared segment: not tried yet (it is set up by the first
    all_reduce that could use it), in use (``all_reduce``), or unavailable (DISTLIB_SHM=0,
    or the group could not map one: its all_reduces go over TCP)."""

    def __init__(self, allowed: bool):
        self.allowed = allowed
        self.tried = False
        self.all_reduce: Optional[ShmAllReduce] = None

    def may_use(self) -> bool:
        """Whether an all_reduce may go through it (set up now if not tried yet)."""
        return self.allowed and (not self.tried or self.all_reduce is not None)

    def set_up(self, segment: Optional[SharedSegment], size: int, slot_bytes: int) -> None:
        """What agree_on_segment gave (None: unavailable from now on)."""
        self.tried = True
        self.all_reduce = ShmAllReduce(segment, size, slot_bytes) if segment is not None else None

    @property
    def state(self) -> str:
        """"on" (in use), "off" (unavailable) or "unset" (not tried yet), for reports."""
        if self.all_reduce is not None:
            return "on"
        return "off" if self.tried or not self.allowed else "unset"

    def close(self) -> None:
        if self.all_reduce is not None:
            self.all_reduce.segment.close()
            self.all_reduce = None
