"""Data movement without reduction over TCP: broadcast, all_gather, gather, scatter, all_to_all,
barrier.

* broadcast: the root sends to everyone (small arrays, or two ranks); split_broadcast, for
  large arrays and more ranks: scatter from the root then a ring all-gather, so the root
  sends the array once instead of n-1 times.
* all_gather: everyone sends to everyone (small); ring_all_gather: a ring that receives
  straight into the output (large).
* all_to_all: receives are posted for every peer before any send, then each rank sends to
  r+1, r+2, ...: every pair's data flows at once and nothing waits on anything else.
* barrier: a dissemination barrier, ceil(log2 n) rounds of empty frames.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import numpy as np

from .context import STEP_STRIDE, OpContext, bview, chunk_bounds, pieces


def broadcast(ctx: OpContext, flat: np.ndarray, root: int) -> None:
    """The root sends ``flat`` to every other rank."""
    n, r = ctx.size, ctx.rank
    if r == root:
        view = bview(flat)
        for i in range(1, n):
            ctx.send((root + i) % n, view, 0)
    else:
        ctx.wait(ctx.post(root, bview(flat), 0))


def split_broadcast(ctx: OpContext, flat: np.ndarray, root: int) -> None:
    """Scatter from the root, then a ring all-gather. Relative rank v = (r - root) % n owns chunk v after the scatter; then the ring.

    The root already holds every chunk: in the ring it sends from its own copy at each step
    and receives nothing, and the rank before it sends it nothing (a quarter less traffic
    at 4 ranks, and none of it into the busiest rank). Every receive is posted before
    anything is sent or awaited (they fill disjoint chunks of ``flat``), so frames land in
    place however far ahead the root and the left neighbour run.
    """
    n, r = ctx.size, ctx.rank
    v = (r - root) % n
    bounds = chunk_bounds(flat.size, n)
    right, left = (r + 1) % n, (r - 1) % n
    itemsize = flat.itemsize
    scatter_slot = None
    slots = []
    if r != root:
        lo, hi = bounds[v]
        scatter_slot = ctx.post(root, bview(flat[lo:hi]), 0)
        for s in range(n - 1):
            lo, hi = bounds[(v - s - 1) % n]
            slots.append([ctx.post(left, bview(flat[a:b]), (1 + s) * STEP_STRIDE + k)
                          for k, (a, b) in enumerate(pieces(lo, hi, itemsize))])
    if scatter_slot is None:  # the root
        for i in range(1, n):
            lo, hi = bounds[i]
            ctx.send((root + i) % n, bview(flat[lo:hi]), 0)
    else:
        ctx.wait(scatter_slot)
    for s in range(n - 1):
        if right != root:
            lo, hi = bounds[(v - s) % n]
            for k, (a, b) in enumerate(pieces(lo, hi, itemsize)):
                ctx.send(right, bview(flat[a:b]), (1 + s) * STEP_STRIDE + k)
        if r != root:
            for slot in slots[s]:
                ctx.wait(slot)


def all_gather(ctx: OpContext, outputs: Sequence[np.ndarray], mine: np.ndarray) -> None:
    """``outputs[k]`` receives rank k's ``mine`` (outputs[r] gets a copy of this rank's):
    every rank sends to every other."""
    n, r = ctx.size, ctx.rank
    outputs[r].reshape(-1)[...] = mine.reshape(-1)
    slots = [ctx.post(p, bview(outputs[p]), 0) for p in range(n) if p != r]
    view = bview(mine)
    for i in range(1, n):
        ctx.send((r + i) % n, view, 0)
    for slot in slots:
        ctx.wait(slot)


def ring_all_gather(ctx: OpContext, outputs: Sequence[np.ndarray], mine: np.ndarray) -> None:
    """all_gather round the ring, each piece received straight into its output."""
    n, r = ctx.size, ctx.rank
    outputs[r].reshape(-1)[...] = mine.reshape(-1)
    right, left = (r + 1) % n, (r - 1) % n
    slots = [ctx.post(left, bview(outputs[(r - s - 1) % n]), 1 + s) for s in range(n - 1)]
    for s in range(n - 1):
        ctx.send(right, bview(outputs[(r - s) % n]), 1 + s)
        ctx.wait(slots[s])


def gather(ctx: OpContext, outputs: Optional[Sequence[np.ndarray]], mine: np.ndarray, root: int) -> None:
    n, r = ctx.size, ctx.rank
    if r != root:
        ctx.send(root, bview(mine), 0)
        return
    assert outputs is not None, "the root's outputs (collectives.gather checks them)"
    slots = [ctx.post(p, bview(outputs[p]), 0) for p in range(n) if p != r]
    outputs[r].reshape(-1)[...] = mine.reshape(-1)
    for slot in slots:
        ctx.wait(slot)


def scatter(ctx: OpContext, output: np.ndarray, inputs: Optional[Sequence[np.ndarray]], root: int) -> None:
    n, r = ctx.size, ctx.rank
    if r != root:
        ctx.wait(ctx.post(root, bview(output), 0))
        return
    assert inputs is not None, "the root's inputs (collectives.scatter checks them)"
    for i in range(1, n):
        p = (root + i) % n
        ctx.send(p, bview(inputs[p]), 0)
    output.reshape(-1)[...] = inputs[r].reshape(-1)


def all_to_all(ctx: OpContext, outputs: Sequence[memoryview], inputs: Sequence[memoryview]) -> None:
    """Byte views: ``inputs[k]`` goes to rank k, ``outputs[k]`` comes from rank k."""
    n, r = ctx.size, ctx.rank
    slots = [ctx.post((r - i) % n, outputs[(r - i) % n], 0) for i in range(1, n)]
    outputs[r][:] = inputs[r]
    for i in range(1, n):
        p = (r + i) % n
        ctx.send(p, inputs[p], 0)
    for slot in slots:
        ctx.wait(slot)


def barrier(ctx: OpContext) -> None:
    n, r = ctx.size, ctx.rank
    empty = memoryview(bytearray(0))
    distance, round_ = 1, 0
    while distance < n:
        slot = ctx.post((r - distance) % n, empty, round_)
        ctx.send((r + distance) % n, empty, round_)
        ctx.wait(slot)
        distance <<= 1
        round_ += 1


def split_views(flat: np.ndarray, splits: List[int], row: int) -> List[memoryview]:
    """Byte views of consecutive row blocks of ``flat`` (``splits[k]`` rows of ``row`` elements)."""
    views, start = [], 0
    for rows in splits:
        end = start + rows * row
        views.append(bview(flat[start:end]))
        start = end
    return views
