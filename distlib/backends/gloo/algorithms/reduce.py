"""Reductions over TCP: all_reduce, reduce, reduce_scatter.

Which algorithm, by size (sizes.py decides; all of them give every rank bit-identical results, because each
element is reduced once, in one fixed order, and then copied):

* **direct** (small arrays, few ranks): every rank sends its whole array to every other and
  reduces all of them in rank order 0, 1, 2, ... One round of latency.
* **recursive doubling** (small arrays, many ranks): log2(n) rounds; a non-power-of-two
  group first folds its extra ranks into the others and unfolds at the end.
* **tree** (small arrays, more ranks than CPUs on the machine): a binomial tree reduces to
  rank 0 and broadcasts back, 2(n-1) frames, the fewest of all (see choose_all_reduce).
* **ring** (large arrays): reduce-scatter then all-gather around the ring, 2(n-1)/n of the
  array per rank on the wire, cut into ~4 MiB pieces (context.PIPE_BYTES) so reducing one
  piece overlaps with receiving the next, and the all-gather receiving straight into the output.
"""

from __future__ import annotations

from typing import List, Optional

import numpy as np

from ....reduce_op import ReduceOp, accumulate, combine
from . import context
from .context import STEP_STRIDE, OpContext, ScratchPool, bview, chunk_bounds, pieces


def in_rank_order(op: ReduceOp, contributions, n: int) -> np.ndarray:
    """``contributions[0] (op) contributions[1] (op) ...``: one order everywhere, so every rank
    that reduces the same inputs gets the same bits."""
    result = contributions[0].reshape(-1).copy()
    for k in range(1, n):
        accumulate(op, result, contributions[k].reshape(-1))
    return result


def direct_all_reduce(ctx: OpContext, flat: np.ndarray, op: ReduceOp) -> None:
    n, r = ctx.size, ctx.rank
    peers = [(r + i) % n for i in range(1, n)]
    inbox = {p: np.empty_like(flat) for p in peers}
    slots = [ctx.post(p, bview(inbox[p]), 0) for p in peers]
    mine = bview(flat)
    for p in peers:
        ctx.send(p, mine, 0)
    for slot in slots:
        ctx.wait(slot)
    inbox[r] = flat
    flat[...] = in_rank_order(op, inbox, n)


def recursive_doubling_all_reduce(ctx: OpContext, flat: np.ndarray, op: ReduceOp) -> None:
    """log2(n) exchange rounds; combine(lower rank's data, higher rank's data) everywhere."""
    n, r = ctx.size, ctx.rank
    p = 1 << (n.bit_length() - 1)  # largest power of two <= n
    extra = n - p
    other = np.empty_like(flat)
    # Fold: ranks p..n-1 hand their data to ranks 0..extra-1.
    if r >= p:
        ctx.send(r - p, bview(flat), 0)
        ctx.wait(ctx.post(r - p, bview(flat), STEP_STRIDE * 63))
        return
    if r < extra:
        ctx.wait(ctx.post(r + p, bview(other), 0))
        combine(op, flat.copy(), other, flat)
    distance, round_ = 1, 1
    while distance < p:
        partner = r ^ distance
        slot = ctx.post(partner, bview(other), STEP_STRIDE * round_)
        ctx.send(partner, bview(flat), STEP_STRIDE * round_)
        ctx.wait(slot)
        if r < partner:
            combine(op, flat.copy(), other, flat)
        else:
            combine(op, other, flat.copy(), flat)
        distance <<= 1
        round_ += 1
    if r < extra:
        ctx.send(r + p, bview(flat), STEP_STRIDE * 63)


def tree_all_reduce(ctx: OpContext, flat: np.ndarray, op: ReduceOp) -> None:
    """Binomial tree: reduce to rank 0 (each rank combines its subtree, lower ranks first),
    then broadcast back down; 2(n-1) frames in all, 2 ceil(log2 n) steps."""
    n, r = ctx.size, ctx.rank
    other = np.empty_like(flat)
    mask = 1
    while mask < n:
        if r & mask:
            ctx.send(r - mask, bview(flat), 0)
            break
        if r + mask < n:
            ctx.wait(ctx.post(r + mask, bview(other), 0))
            accumulate(op, flat, other)
        mask <<= 1
    if r:
        ctx.wait(ctx.post(r - (r & -r), bview(flat), 1))
        mask = (r & -r) >> 1
    else:
        mask = 1 << max(0, (n - 1).bit_length() - 1)
    while mask:
        if r + mask < n:
            ctx.send(r + mask, bview(flat), 1)
        mask >>= 1


def ring(ctx: OpContext, flat: np.ndarray, op: Optional[ReduceOp], owner_shift: int,
         reduce_phase: bool, gather_phase: bool) -> List[tuple]:
    """The ring, pipelined by pieces across steps and phases; returns the chunk bounds.

    Reduce phase (n-1 steps): step s sends chunk ``r + o - 1 - s`` to the right and reduces
    chunk ``r + o - 2 - s`` from the left into ``flat``; afterwards rank r holds chunk
    ``r + o`` fully reduced (o = ``owner_shift``). Gather phase (n-1 steps): step t sends
    chunk ``r + o - t`` and receives chunk ``r + o - t - 1`` straight into ``flat``.
    In both, what arrives at step s is what leaves at step s+1, so each piece is forwarded
    the moment it is reduced (or received): sending, receiving and reducing overlap.

    Receives are posted ahead, so that a frame from a left neighbour that runs ahead lands
    where it belongs instead of in a temporary buffer (an allocation and a second copy):
    every gather step at once (it receives into ``flat``: a chunk's final value can only
    arrive after this rank has sent its own part of it, so nothing this rank still reads is
    overwritten), and reduce steps up to ``depth`` ahead, each into its own scratch slot
    (``depth`` slots of one chunk, within ScratchPool's limit).
    """
    n, r = ctx.size, ctx.rank
    right, left = (r + 1) % n, (r - 1) % n
    bounds = chunk_bounds(flat.size, n)
    chunk_pieces = [pieces(lo, hi, flat.itemsize) for lo, hi in bounds]
    steps = ([("reduce", s) for s in range(n - 1)] if reduce_phase else []) + \
            ([("gather", t) for t in range(n - 1)] if gather_phase else [])
    if not steps:
        return bounds

    def sent_chunk(kind: str, i: int) -> int:
        return (r + owner_shift - 1 - i) % n if kind == "reduce" else (r + owner_shift - i) % n

    longest = max(hi - lo for lo, hi in bounds)
    depth = 1
    pool = raw = None
    if reduce_phase:
        depth = min(n - 1, max(2, context.SCRATCH_LIMIT // max(1, longest * flat.itemsize)))
        pool = ScratchPool.of(ctx.mesh)
        raw = pool.take(depth * longest * flat.itemsize)
        scratch = raw.view(flat.dtype).reshape(depth, longest)

    def post(index: int):
        kind, i = steps[index]
        chunk = (sent_chunk(kind, i) - 1) % n
        lo = bounds[chunk][0]
        target = scratch[index % depth] if kind == "reduce" else flat
        offset = lo if kind == "reduce" else 0
        return [(ctx.post(left, bview(target[a - offset:b - offset]), index * STEP_STRIDE + k), a, b,
                 target[a - offset:b - offset]) for k, (a, b) in enumerate(chunk_pieces[chunk])]

    try:
        posted = {}
        reduce_steps = n - 1 if reduce_phase else 0
        for index in range(min(depth, reduce_steps)):
            posted[index] = post(index)
        for index in range(reduce_steps, len(steps)):
            posted[index] = post(index)
        first = sent_chunk(*steps[0])
        for k, (a, b) in enumerate(chunk_pieces[first]):
            ctx.send(right, bview(flat[a:b]), k)
        for index, (kind, _) in enumerate(steps):
            forward = index + 1 < len(steps)
            for k, (slot, a, b, buf) in enumerate(posted.pop(index)):
                ctx.wait(slot)
                if kind == "reduce":
                    assert op is not None, "a reduce phase has its op"
                    accumulate(op, flat[a:b], buf)
                if forward:
                    ctx.send(right, bview(flat[a:b]), (index + 1) * STEP_STRIDE + k)
            ahead = index + depth  # its scratch slot was this step's, now consumed
            if kind == "reduce" and ahead < reduce_steps:
                posted[ahead] = post(ahead)
    finally:
        if pool is not None and raw is not None:  # taken together
            pool.release(raw)
    return bounds


def ring_all_reduce(ctx: OpContext, flat: np.ndarray, op: ReduceOp) -> None:
    ring(ctx, flat, op, owner_shift=1, reduce_phase=True, gather_phase=True)


def direct_reduce(ctx: OpContext, flat: np.ndarray, root: int, op: ReduceOp) -> None:
    n, r = ctx.size, ctx.rank
    if r != root:
        ctx.send(root, bview(flat), 0)
        return
    inbox = {p: np.empty_like(flat) for p in range(n) if p != r}
    slots = [ctx.post(p, bview(buf), 0) for p, buf in inbox.items()]
    for slot in slots:
        ctx.wait(slot)
    inbox[r] = flat
    flat[...] = in_rank_order(op, inbox, n)


def ring_reduce(ctx: OpContext, flat: np.ndarray, root: int, op: ReduceOp) -> None:
    """Reduce-scatter round the ring (``flat`` is scratch on non-roots), then every owner
    sends its reduced chunk to the root."""
    n, r = ctx.size, ctx.rank
    bounds = ring(ctx, flat, op, owner_shift=0, reduce_phase=True, gather_phase=False)
    phase = n * STEP_STRIDE
    if r != root:
        lo, hi = bounds[r]
        ctx.send(root, bview(flat[lo:hi]), phase)
        return
    slots = [ctx.post(p, bview(flat[bounds[p][0]:bounds[p][1]]), phase) for p in range(n) if p != r]
    for slot in slots:
        ctx.wait(slot)


def direct_reduce_scatter(ctx: OpContext, parts: List[np.ndarray], output: np.ndarray, op: ReduceOp) -> None:
    """``parts[k]`` (this rank's contribution to rank k) → ``output`` = reduction of parts[r]."""
    n, r = ctx.size, ctx.rank
    inbox = {p: np.empty_like(parts[r]) for p in range(n) if p != r}
    slots = [ctx.post(p, bview(buf), 0) for p, buf in inbox.items()]
    for i in range(1, n):
        p = (r + i) % n
        ctx.send(p, bview(parts[p]), 0)
    for slot in slots:
        ctx.wait(slot)
    inbox[r] = parts[r]
    output.reshape(-1)[...] = in_rank_order(op, inbox, n)


def ring_reduce_scatter_into(ctx: OpContext, work: np.ndarray, output: np.ndarray, op: ReduceOp) -> None:
    """``work`` (a scratch copy of the full input) → ``output`` = reduced chunk r."""
    bounds = ring(ctx, work, op, owner_shift=0, reduce_phase=True, gather_phase=False)
    lo, hi = bounds[ctx.rank]
    output.reshape(-1)[...] = work[lo:hi]


#: The algorithms by name, as sizes.choose_all_reduce names them.
ALL_REDUCE = {
    "direct": direct_all_reduce,
    "recursive_doubling": recursive_doubling_all_reduce,
    "tree": tree_all_reduce,
    "ring": ring_all_reduce,
}
