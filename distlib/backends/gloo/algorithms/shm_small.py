"""Small collectives through the same-host channel (transport/shm_channel.py).

Each is one exchange: every rank writes its contribution into its own slot and waits for
everyone's, then reads what it needs. Every rank waits for every other, even where the data
flows one way (broadcast, gather, reduce): that is what lets the channel reuse its slots
without ever waiting for a reader (see the channel's docstring). Reductions read the slots
in rank order 0, 1, 2, ... on every rank that reduces, so all ranks get the same bits, as
over TCP.

``seq`` is the group's operation number (the same on every rank); ``word`` and ``count``
describe the operation for the mismatch checks (channel.descriptor).
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence

import numpy as np

from ..transport.shm_channel import SUB_BITS, SmallChannel

_BYTES = np.dtype(np.uint8)


def _reduce_into(out: np.ndarray, parts: Sequence[np.ndarray], combine: Callable, lo: int = 0,
                 hi: Optional[int] = None) -> None:
    """``out = parts[0][lo:hi] (op) parts[1][lo:hi] (op) ...``, left to right (``combine``:
    the reduce op's ufunc for the dtype, reduce_op.kernel)."""
    if hi is None:
        combine(parts[0], parts[1], out=out)
        for part in parts[2:]:
            combine(out, part, out=out)
        return
    combine(parts[0][lo:hi], parts[1][lo:hi], out=out)
    for part in parts[2:]:
        combine(out, part[lo:hi], out=out)


def _exchange(ch: SmallChannel, seq: int, word: int, count: int, dtype: np.dtype, elements: int,
              mine: Optional[np.ndarray] = None, pieces: Sequence[np.ndarray] = ()) -> List[np.ndarray]:
    """One exchange: this rank's contribution (``mine``, or ``pieces`` one after another)
    into its slot, published; every rank's awaited. Returns the slots as ``elements``
    elements of ``dtype``, per rank."""
    stamp = (seq + 1) << SUB_BITS  # channel.stamp(seq), inline: a call costs ~5 % of a small operation
    p = ch.next_set()
    slots = ch.views(dtype, elements)[p]
    if mine is not None:
        slots[ch.rank][...] = mine
    elif pieces:
        slot, offset = slots[ch.rank], 0
        for piece in pieces:
            slot[offset:offset + piece.size] = piece
            offset += piece.size
    ch.publish(p, stamp, word, count)
    ch.await_all(p, stamp, word, count)
    return slots


def all_reduce(ch: SmallChannel, seq: int, flat: np.ndarray, combine: Callable, word: int) -> None:
    _reduce_into(flat, _exchange(ch, seq, word, flat.size, flat.dtype, flat.size, flat), combine)


def reduce(ch: SmallChannel, seq: int, flat: np.ndarray, root: int, combine: Callable, word: int) -> None:
    """``flat`` is this rank's contribution; on the root it receives the result."""
    slots = _exchange(ch, seq, word, flat.size, flat.dtype, flat.size, flat)
    if ch.rank == root:
        _reduce_into(flat, slots, combine)


def broadcast(ch: SmallChannel, seq: int, flat: np.ndarray, root: int, word: int) -> None:
    slots = _exchange(ch, seq, word, flat.size, flat.dtype, flat.size, flat if ch.rank == root else None)
    if ch.rank != root:
        flat[...] = slots[root]


def barrier(ch: SmallChannel, seq: int, word: int) -> None:
    _exchange(ch, seq, word, 0, _BYTES, 0)


def all_gather(ch: SmallChannel, seq: int, outputs: Sequence[np.ndarray], mine: np.ndarray, word: int) -> None:
    """``outputs[k]`` (flat views) receives rank k's ``mine``."""
    slots = _exchange(ch, seq, word, mine.size, mine.dtype, mine.size, mine)
    for k, out in enumerate(outputs):
        out[...] = slots[k]


def gather(ch: SmallChannel, seq: int, outputs: Optional[Sequence[np.ndarray]], mine: np.ndarray, root: int,
           word: int) -> None:
    slots = _exchange(ch, seq, word, mine.size, mine.dtype, mine.size, mine)
    if ch.rank == root:
        assert outputs is not None, "the root's outputs (collectives.gather checks them)"
        for k, out in enumerate(outputs):
            out[...] = slots[k]


def scatter(ch: SmallChannel, seq: int, output: np.ndarray, inputs: Optional[Sequence[np.ndarray]], root: int,
            word: int) -> None:
    """The root's slot holds every rank's piece, one after another."""
    m = output.size
    pieces: Sequence[np.ndarray] = ()
    if ch.rank == root:
        assert inputs is not None, "the root's inputs (collectives.scatter checks them)"
        pieces = inputs
    slots = _exchange(ch, seq, word, m, output.dtype, m * ch.size, pieces=pieces)
    output[...] = slots[root][ch.rank * m:(ch.rank + 1) * m]


def reduce_scatter(ch: SmallChannel, seq: int, parts: List[np.ndarray], output: np.ndarray, combine: Callable,
                   word: int) -> None:
    """``parts[k]``: this rank's contribution to rank k; ``output`` = the reduction of parts[r]."""
    m, r = output.size, ch.rank
    slots = _exchange(ch, seq, word, m, output.dtype, m * ch.size, pieces=parts)
    _reduce_into(output, slots, combine, r * m, (r + 1) * m)
