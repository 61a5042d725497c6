"""all_reduce through shared memory, for a group whose ranks all share one host.

The array is processed in rounds of at most ``slot`` bytes per rank. In each round:

1. every rank copies its piece into its own slot of the segment;
2. barrier;
3. rank r reduces chunk r of the piece across all slots, in place in its own slot (only
   rank r touches chunk r of slot r, so no two ranks write the same bytes);
4. barrier;
5. every rank copies the n reduced chunks into its output.

Each element is reduced by exactly one rank, so every rank ends with bit-identical results.
Rounds alternate between two sets of slots, so step 5 of one round overlaps with step 1 of
the next and only two barriers per round are needed (the barrier in step 2 of round i+1
proves everyone has finished step 5 of round i-1, whose slots round i+1 reuses). Rounds are
numbered across calls, so this holds from one all_reduce to the next as well. A rank
moves about 3x the array through memory, against 2(n-1)/n x through the TCP stack (at
~3 GB/s) plus the copies into and out of socket buffers.

The barriers go through the group's small-collective channel when it has one (a stamp in
shared memory and a check of every rank's descriptor: microseconds, where a barrier of empty
frames on the mesh costs two rounds of TCP wake-ups), else over the mesh. Either way a rank
that dies is noticed as in any collective, and ranks that disagree on the size are told.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from ....errors import DistBackendError
from ....reduce_op import ReduceOp, accumulate
from ..transport.shm import SharedSegment
from ..transport.shm_channel import SUB_BITS, SmallChannel, descriptor, stamp
from ..transport.shm_wait import LONG
from .context import STEP_STRIDE, OpContext, chunk_bounds


def mesh_barrier(ctx: OpContext, base: int, count: Optional[int] = None) -> None:
    """Dissemination barrier with step numbers from ``base``.

    With ``count``, every frame carries this rank's element count and every rank compares
    what it receives with its own: in round 0 each rank hears from its left neighbour, so if
    any two ranks disagree some neighbour pair does, and that rank aborts the group with the
    two sizes (shared memory has no frame sizes to give a mismatch away).
    """
    n, r = ctx.size, ctx.rank
    mine = np.array([count if count is not None else 0], np.int64)
    heard = np.zeros(1, np.int64)
    # an ndarray is a buffer: numpy's stubs declare it (PEP 688) for Python >= 3.12 only
    payload = memoryview(mine.view(np.uint8)) if count is not None else memoryview(bytearray(0))  # type: ignore[arg-type]  # see above
    inbox = memoryview(heard.view(np.uint8)) if count is not None else memoryview(bytearray(0))  # type: ignore[arg-type]  # see above
    distance, round_ = 1, 0
    while distance < n:
        source = (r - distance) % n
        slot = ctx.post(source, inbox, base + round_)
        ctx.send((r + distance) % n, payload, base + round_)
        ctx.wait(slot)
        if count is not None and heard[0] != mine[0]:
            error = DistBackendError(
                f"{ctx.mesh.label}: mismatched collective: rank {source} is in all_reduce of {int(heard[0])} "
                f"elements but rank {r} of {int(mine[0])}: the arrays have different sizes on different ranks")
            ctx.mesh.abort(error)
            raise error
        distance <<= 1
        round_ += 1


class ShmAllReduce:
    """The shared slots of one group: 2 sets x n ranks x ``slot`` bytes."""

    def __init__(self, segment: SharedSegment, size: int, slot: int):
        self.segment = segment
        self.size = size
        self.slot = slot
        # Rounds are counted across operations: the slot set alternates from one round to the
        # next even when they belong to different all_reduce calls (otherwise a rank starting
        # the next call could overwrite a slot a slower rank is still copying out of).
        self.rounds = 0

    @staticmethod
    def bytes_needed(size: int, slot: int) -> int:
        return 2 * size * slot

    def _slot_array(self, which: int, rank: int, dtype: np.dtype, count: int) -> np.ndarray:
        offset = (which * self.size + rank) * self.slot
        mm = self.segment.mm
        assert mm is not None, "a segment is mapped until it is closed"
        return np.frombuffer(mm, dtype=dtype, count=count, offset=offset)

    def run(self, ctx: OpContext, flat: np.ndarray, op: ReduceOp, channel: Optional[SmallChannel] = None) -> None:
        n, r = ctx.size, ctx.rank
        per_round = max(1, self.slot // flat.itemsize)
        total = flat.size
        word = descriptor(ctx.op, ctx.dtype, ctx.redop, -1)
        if channel is not None and total > per_round << (SUB_BITS - 1):
            channel = None  # more rounds than stamps can number (terabytes): barriers over the mesh
        round_ = 0

        def barrier(sub: int) -> None:
            if channel is None:
                mesh_barrier(ctx, sub * STEP_STRIDE, count=total if sub == 0 else None)
                return
            p = channel.next_set()
            mark = stamp(ctx.seq, sub)
            channel.publish(p, mark, word, total)
            channel.await_all(p, mark, word, total, LONG)

        for start in range(0, total, per_round):
            m = min(per_round, total - start)
            which = self.rounds % 2
            self.rounds += 1
            piece = flat[start:start + m]
            slots = [self._slot_array(which, k, flat.dtype, m) for k in range(n)]
            np.copyto(slots[r], piece)
            barrier(2 * round_)
            bounds = chunk_bounds(m, n)
            lo, hi = bounds[r]
            if hi > lo:
                mine = slots[r][lo:hi]
                for k in range(n):
                    if k != r:
                        accumulate(op, mine, slots[k][lo:hi])
            barrier(2 * round_ + 1)
            for k, (a, b) in enumerate(bounds):
                if b > a:
                    np.copyto(piece[a:b], slots[k][a:b])
            del slots, piece
            round_ += 1
