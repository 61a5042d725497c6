"""Where each collective of the gloo backend goes: one route table per collective.

A collective goes

* **SMALL**: through the small-collective channel (transport/shm_channel.py, algorithms/
  shm_small.py) when the group has one (every rank on this host) and every rank's part fits
  its slot: one exchange in shared memory, no system call when the ranks are running;
* **SEGMENT** (all_reduce only): through the large shared segment (algorithms/
  shm_allreduce.py), set up on the first all_reduce that could use it
  (shared_segments.LargeSegment);
* **MESH**: over the TCP mesh, with the algorithm the size calls for (algorithms/reduce.py,
  algorithms/gather.py).

``GlooBackend.route`` picks the route; each table maps it to a function of the backend
``b`` (gloo.py) and the collective's arguments, which takes the operation's number and runs
the algorithm. As algorithms/reduce.py's ``ALL_REDUCE`` table is for the algorithms over TCP.
"""

from __future__ import annotations

from typing import Callable, Dict, List

import numpy as np

from .algorithms import gather as gather_algos
from .algorithms import reduce as reduce_algos
from .algorithms import shm_small
from ...arrays import DTYPE_CODES as _DTYPES
from ...reduce_op import ReduceOp, prepare_input
from .transport import frames, shm_channel

SMALL, SEGMENT, MESH = "small", "segment", "mesh"
#: A reduce or reduce_scatter whose data per rank times the peers is at most this goes
#: directly (every rank to the root, or to its owner), above it around a ring.
DIRECT_BYTES = 256 << 10

_ALL_REDUCE, _BROADCAST, _REDUCE = frames.OPS["all_reduce"], frames.OPS["broadcast"], frames.OPS["reduce"]
_ALL_GATHER, _GATHER, _SCATTER = frames.OPS["all_gather"], frames.OPS["gather"], frames.OPS["scatter"]
_REDUCE_SCATTER = frames.OPS["reduce_scatter"]
_BARRIER_WORD = shm_channel.descriptor(frames.OPS["barrier"], 0, 0, -1)


def _word(code: int, array: np.ndarray, root: int = -1) -> int:
    return shm_channel.descriptor(code, _DTYPES.get(array.dtype, 0), 0, root)


# -- all_reduce (flat, op): in place ---------------------------------------------------------------

def _all_reduce_small(b, flat: np.ndarray, op: ReduceOp) -> None:
    word, combine = b.reduction(_ALL_REDUCE, op, flat.dtype)
    shm_small.all_reduce(b.small, b.take_seq(), flat, combine, word)


def _all_reduce_segment(b, flat: np.ndarray, op: ReduceOp) -> None:
    # its barriers go through the channel (if any): an operation of the channel, not announced
    ctx = b.op_context("all_reduce", flat, op, "all_reduce of {} x {}", flat.size, flat.dtype, announce=False)
    b.large.all_reduce.run(ctx, flat, op, b.small)


def _all_reduce_mesh(b, flat: np.ndarray, op: ReduceOp) -> None:
    ctx = b.op_context("all_reduce", flat, op, "all_reduce of {} x {}", flat.size, flat.dtype)
    reduce_algos.ALL_REDUCE[reduce_algos.choose_all_reduce(flat.nbytes, b.size, b.crowded)](ctx, flat, op)


ALL_REDUCE: Dict[str, Callable] = {SMALL: _all_reduce_small, SEGMENT: _all_reduce_segment, MESH: _all_reduce_mesh}


# -- broadcast (flat, root) ------------------------------------------------------------------------

def _broadcast_small(b, flat: np.ndarray, root: int) -> None:
    shm_small.broadcast(b.small, b.take_seq(), flat, root, _word(_BROADCAST, flat, root))


def _broadcast_mesh(b, flat: np.ndarray, root: int) -> None:
    ctx = b.op_context("broadcast", flat, None, "broadcast of {} x {} from rank {}", flat.size, flat.dtype, root,
                       root=root)
    gather_algos.broadcast(ctx, flat, root)


BROADCAST: Dict[str, Callable] = {SMALL: _broadcast_small, MESH: _broadcast_mesh}


# -- reduce (flat, work, root, op) -> the array the result is in at the root ----------------------

def _reduce_small(b, flat: np.ndarray, work: np.ndarray, root: int, op: ReduceOp) -> np.ndarray:
    word, combine = b.reduction(_REDUCE, op, flat.dtype, root)
    if b.rank == root and work is not flat:
        flat[...] = work
        work = flat
    shm_small.reduce(b.small, b.take_seq(), work, root, combine, word)
    return work


def _reduce_mesh(b, flat: np.ndarray, work: np.ndarray, root: int, op: ReduceOp) -> np.ndarray:
    ctx = b.op_context("reduce", flat, op, "reduce of {} x {} to rank {}", flat.size, flat.dtype, root, root=root)
    if work is flat and b.rank != root:
        work = flat.copy()
    if flat.nbytes * (b.size - 1) <= DIRECT_BYTES:
        reduce_algos.direct_reduce(ctx, work, root, op)
    else:
        reduce_algos.ring_reduce(ctx, work, root, op)
    return work


REDUCE: Dict[str, Callable] = {SMALL: _reduce_small, MESH: _reduce_mesh}


# -- all_gather (outputs, array) -------------------------------------------------------------------

def _all_gather_small(b, outputs, array: np.ndarray) -> None:
    shm_small.all_gather(b.small, b.take_seq(), [o.reshape(-1) for o in outputs], array.reshape(-1),
                         _word(_ALL_GATHER, array))


def _all_gather_mesh(b, outputs, array: np.ndarray) -> None:
    gather_algos.all_gather(b.op_context("all_gather", array, None, "all_gather of {} x {}", array.size, array.dtype),
                            outputs, array)


ALL_GATHER: Dict[str, Callable] = {SMALL: _all_gather_small, MESH: _all_gather_mesh}


# -- gather (outputs, array, root) -----------------------------------------------------------------

def _gather_small(b, outputs, array: np.ndarray, root: int) -> None:
    flat_outputs = [o.reshape(-1) for o in outputs] if outputs is not None else None
    shm_small.gather(b.small, b.take_seq(), flat_outputs, array.reshape(-1), root, _word(_GATHER, array, root))


def _gather_mesh(b, outputs, array: np.ndarray, root: int) -> None:
    ctx = b.op_context("gather", array, None, "gather of {} x {} to rank {}", array.size, array.dtype, root, root=root)
    gather_algos.gather(ctx, outputs, array, root)


GATHER: Dict[str, Callable] = {SMALL: _gather_small, MESH: _gather_mesh}


# -- scatter (output, inputs, root) ----------------------------------------------------------------

def _scatter_small(b, output: np.ndarray, inputs, root: int) -> None:
    pieces = [i.reshape(-1) for i in inputs] if inputs is not None else None
    shm_small.scatter(b.small, b.take_seq(), output.reshape(-1), pieces, root, _word(_SCATTER, output, root))


def _scatter_mesh(b, output: np.ndarray, inputs, root: int) -> None:
    ctx = b.op_context("scatter", output, None, "scatter of {} x {} from rank {}", output.size, output.dtype, root,
                root=root)
    gather_algos.scatter(ctx, output, inputs, root)


SCATTER: Dict[str, Callable] = {SMALL: _scatter_small, MESH: _scatter_mesh}


# -- reduce_scatter (output, parts, op): parts already prepared (prepare_input) -------------------

def _reduce_scatter_small(b, output: np.ndarray, parts: List[np.ndarray], op: ReduceOp) -> None:
    word, combine = b.reduction(_REDUCE_SCATTER, op, output.dtype)
    shm_small.reduce_scatter(b.small, b.take_seq(), parts, output.reshape(-1), combine, word)


def _reduce_scatter_mesh(b, output: np.ndarray, parts: List[np.ndarray], op: ReduceOp) -> None:
    ctx = b.op_context("reduce_scatter", output, op, "reduce_scatter of {} x {}", output.size, output.dtype)
    reduce_algos.direct_reduce_scatter(ctx, parts, output, op)


REDUCE_SCATTER: Dict[str, Callable] = {SMALL: _reduce_scatter_small, MESH: _reduce_scatter_mesh}


# -- reduce_scatter_into (output, flat, op): flat holds every rank's part in order -----------------

def _parts(b, flat: np.ndarray, m: int, op: ReduceOp) -> List[np.ndarray]:
    return [prepare_input(op, flat[k * m:(k + 1) * m]) for k in range(b.size)]


def _reduce_scatter_into_small(b, output: np.ndarray, flat: np.ndarray, op: ReduceOp) -> None:
    _reduce_scatter_small(b, output, _parts(b, flat, output.size, op), op)


def _reduce_scatter_into_mesh(b, output: np.ndarray, flat: np.ndarray, op: ReduceOp) -> None:
    ctx = b.op_context("reduce_scatter", output, op, "reduce_scatter of {} x {}", output.size, output.dtype)
    if output.nbytes * (b.size - 1) <= DIRECT_BYTES:
        reduce_algos.direct_reduce_scatter(ctx, _parts(b, flat, output.size, op), output, op)
    else:
        work = prepare_input(op, flat)
        work = work.copy() if work is flat else work
        reduce_algos.ring_reduce_scatter_into(ctx, work, output, op)


REDUCE_SCATTER_INTO: Dict[str, Callable] = {SMALL: _reduce_scatter_into_small, MESH: _reduce_scatter_into_mesh}


# -- barrier () ------------------------------------------------------------------------------------

def _barrier_small(b) -> None:
    shm_small.barrier(b.small, b.take_seq(), _BARRIER_WORD)


def _barrier_mesh(b) -> None:
    gather_algos.barrier(b.op_context("barrier", None, None, "barrier"))


BARRIER: Dict[str, Callable] = {SMALL: _barrier_small, MESH: _barrier_mesh}
