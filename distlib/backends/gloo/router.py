"""``Router``: where each collective of a gloo group goes, and what every route shares.

It owns three things that each route would otherwise reach into the backend for:

* **the operation numbering** (``seq``): every collective takes the next number, whichever
  way it goes; ranks that call the same collectives number them alike, which is what the
  frames' and the small channel's mismatch checks compare;
* **the announcement**: a collective that does not go through the small channel says so
  there first (``SmallChannel.announce``), so that a rank waiting in the channel for this
  one learns why it does not come;
* **every size threshold**, through its policy (sizes.py): the route, and the algorithm over
  the mesh.

A collective goes

* **SMALL** through the small-collective channel (transport/shm_channel.py, algorithms/
  shm_small.py) when the group has one (every rank on this host) and every rank's part fits
  its slot: one exchange in shared memory, no system call when the ranks are running;
* **SEGMENT** (all_reduce only) through the large shared segment (algorithms/
  shm_allreduce.py), set up on the first all_reduce that could use it
  (shared_segments.LargeSegment);
* **MESH** over the TCP mesh, with the algorithm the size calls for (algorithms/reduce.py,
  algorithms/gather.py).

What it calls are functions of their inputs: the small channel's take (channel, number,
arrays, descriptor word, kernel), the mesh's take an operation's context (algorithms/
context.py) and the arrays. Arrays arrive flat and prepared (backend.py does AVG's and
PREMUL_SUM's arithmetic and the one-rank shortcuts).
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ...arrays import DTYPE_CODES as _DTYPES
from ...deadline import Deadline
from ...errors import DistBackendError
from ...reduce_op import ReduceOp, kernel, prepare_input
from ..base import refused_after_failure
from . import sizes
from .algorithms import gather as gather_algos
from .algorithms import p2p, shm_small
from .algorithms import reduce as reduce_algos
from .algorithms.context import Label, OpContext
from .algorithms.shm_allreduce import ShmAllReduce
from .shared_segments import LargeSegment, agree_on_segment
from .transport import frames, shm_channel
from .transport.shm_channel import SmallChannel
from .transport.tcp import Mesh

_ALL_REDUCE, _BROADCAST, _REDUCE = frames.OPS["all_reduce"], frames.OPS["broadcast"], frames.OPS["reduce"]
_ALL_GATHER, _GATHER, _SCATTER = frames.OPS["all_gather"], frames.OPS["gather"], frames.OPS["scatter"]
_REDUCE_SCATTER = frames.OPS["reduce_scatter"]
_BARRIER_WORD = shm_channel.descriptor(frames.OPS["barrier"], 0, 0, -1)

#: (descriptor word, kernel) of a reduction through the channel.
Reduction = Tuple[int, Callable[..., Any]]


def close(meshes: List[Mesh], small: Optional[SmallChannel], large: LargeSegment) -> None:
    """Close what a group set up (also a group whose setup failed half-way)."""
    for mesh in meshes:
        mesh.close()
    meshes.clear()
    if small is not None:
        small.close()
    large.close()


def _word(code: int, array: np.ndarray, root: int = -1) -> int:
    return shm_channel.descriptor(code, _DTYPES.get(array.dtype, 0), 0, root)


class Router:
    """The routes of one gloo group's collectives (see the module docstring): rank ``rank``
    of ``size``, its ``meshes`` (collectives round-robin over them), its large segment, and
    its small channel once set up (``use_channel``: setting it up takes operations of the
    group's numbering)."""

    def __init__(self, rank: int, size: int, meshes: List[Mesh], large: LargeSegment, all_local: bool,
                 crowded: bool, timeout_s: float, label: str):
        self.rank, self.size = rank, size
        self.meshes = meshes
        self.large = large
        self.all_local, self.crowded = all_local, crowded
        self.timeout_s, self.label = timeout_s, label
        #: The next operation's number.
        self.seq = 0
        #: The small channel: None when not every rank is on this host, or shared memory is off
        self.small: Optional[SmallChannel] = None
        self._reductions: Dict[tuple, Reduction] = {}
        #: The group's first failure (a mismatch, a timeout, a lost peer, an abort, here or on
        #: any rank): from then on every operation is refused, naming it (``refusal``)
        self.failure: Optional[BaseException] = None
        for mesh in meshes:
            mesh.health.on_failure(self._failed)

    def _failed(self, error: BaseException) -> None:
        """A mesh's health failed (before any thread can see it: health.failure_hooks)."""
        if self.failure is None:
            self.failure = error

    def refusal(self) -> DistBackendError:
        """The error of an operation on a group that failed: it names the first failure. A
        group stays failed until it is destroyed: ranks that both saw the failure could still
        meet in the small channel, whose exchange needs no frame, and succeed there while
        another rank raises."""
        return refused_after_failure(self.label, self.rank, self.failure or DistBackendError(
            f"{self.label}: the group failed"))

    def use_channel(self, channel: Optional[SmallChannel]) -> None:
        """Collectives whose part per rank fits ``channel``'s slot go through it from now on."""
        self.small = channel

    def close(self) -> None:
        """Close the meshes, the channel and the segment (every later operation fails)."""
        close(self.meshes, self.small, self.large)
        self.use_channel(None)

    # -- what every route shares -----------------------------------------------------------------

    def context(self, op_name: str, array: Optional[np.ndarray], redop: Optional[ReduceOp], what: str,
                *args: Any, root: int = -1, announce: bool = True) -> OpContext:
        """The next operation's context, for an operation that goes over the mesh (and, in a
        group with a small channel, announced there unless ``announce`` is False: the channel
        takes part in it). ``what.format(*args)`` names it in errors (formatted only then)."""
        seq = self.seq
        self.seq += 1
        mesh = self.meshes[seq % len(self.meshes)]
        dtype = _DTYPES.get(array.dtype, 0) if array is not None else 0
        count = array.size if array is not None else 0
        op = frames.OPS[op_name]
        redop_code = redop.code if redop is not None else 0
        if self.small is not None and announce:
            self.small.announce(shm_channel.stamp(seq), shm_channel.descriptor(op, dtype, redop_code, root), count)
        mesh.begin(seq, op, dtype, redop_code, count)
        return OpContext(mesh, seq, op_name, dtype, redop_code, count, Deadline(self.timeout_s),
                         Label(what + " (op #{})", *args, seq))

    def take_seq(self) -> int:
        """The next operation's number, taken (an operation through the small channel)."""
        seq = self.seq
        self.seq = seq + 1
        return seq

    def reduction(self, code: int, op: ReduceOp, dtype: np.dtype, root: int = -1) -> Reduction:
        """(descriptor word, kernel) of a reduction through the channel, kept: working them out
        costs about a tenth of a small all_reduce."""
        key = (code, op.op, dtype, root)
        found = self._reductions.get(key)
        if found is None:
            word = shm_channel.descriptor(code, _DTYPES.get(dtype, 0), op.code, root)
            found = self._reductions[key] = (word, kernel(op, dtype))
        return found

    @property
    def shm_state(self) -> str:
        """Whether all_reduce goes through shared memory: "on" (the small channel, or the large
        segment once set up), "off" (it cannot), "unset" (no channel, and no large all_reduce yet)."""
        return "on" if self.small is not None else self.large.state

    # -- all_reduce: the three routes ------------------------------------------------------------

    def all_reduce(self, flat: np.ndarray, op: ReduceOp) -> None:
        """``flat`` (prepared) reduced in place over the group."""
        nbytes = flat.nbytes
        small = self.small
        if small is not None and nbytes <= small.slot_bytes:
            word, combine = self.reduction(_ALL_REDUCE, op, flat.dtype)
            shm_small.all_reduce(small, self.take_seq(), flat, combine, word)
            return
        segment = self._segment_for(flat, op)
        if segment is not None:
            # its barriers go through the channel (if any): an operation of the channel, not announced
            ctx = self.context("all_reduce", flat, op, "all_reduce of {} x {}", flat.size, flat.dtype, announce=False)
            segment.run(ctx, flat, op, small)
            return
        ctx = self.context("all_reduce", flat, op, "all_reduce of {} x {}", flat.size, flat.dtype)
        reduce_algos.ALL_REDUCE[sizes.choose_all_reduce(nbytes, self.size, self.crowded)](ctx, flat, op)

    def _segment_for(self, flat: np.ndarray, op: ReduceOp) -> Optional[ShmAllReduce]:
        """The shared segment a large all_reduce goes through, or None (set up on first use,
        before the operation's own context is made: the setup is operations of its own)."""
        large, small = self.large, self.small
        least = sizes.segment_min_bytes(small.slot_bytes if small is not None else -1)
        if not self.all_local or flat.nbytes < least or not large.may_use():
            return None
        if not large.tried:
            if small is not None:  # a rank waiting in the channel sees the all_reduce, not the setup
                word = shm_channel.descriptor(_ALL_REDUCE, _DTYPES.get(flat.dtype, 0), op.code, -1)
                small.announce(shm_channel.stamp(self.seq), word, flat.size)
            segment = agree_on_segment(partial(self.context, announce=False), self.rank,
                                       ShmAllReduce.bytes_needed(self.size, sizes.SEGMENT_SLOT_BYTES),
                                       "large all_reduce", self.label)
            large.set_up(segment, self.size, sizes.SEGMENT_SLOT_BYTES)
        return large.all_reduce

    # -- the others: the small channel or the mesh -----------------------------------------------

    def broadcast(self, flat: np.ndarray, root: int) -> None:
        small = self.small
        if small is not None and flat.nbytes <= small.slot_bytes:
            shm_small.broadcast(small, self.take_seq(), flat, root, _word(_BROADCAST, flat, root))
            return
        ctx = self.context("broadcast", flat, None, "broadcast of {} x {} from rank {}", flat.size, flat.dtype, root,
                           root=root)
        if sizes.broadcast_splits(flat.nbytes, self.size):
            gather_algos.split_broadcast(ctx, flat, root)
        else:
            gather_algos.broadcast(ctx, flat, root)

    def reduce(self, flat: np.ndarray, work: np.ndarray, root: int, op: ReduceOp) -> np.ndarray:
        """``work`` (``flat`` prepared, or ``flat`` itself) reduced to ``root``; returns the
        array the result is in at the root."""
        small = self.small
        if small is not None and flat.nbytes <= small.slot_bytes:
            word, combine = self.reduction(_REDUCE, op, flat.dtype, root)
            if self.rank == root and work is not flat:
                flat[...] = work
                work = flat
            shm_small.reduce(small, self.take_seq(), work, root, combine, word)
            return work
        ctx = self.context("reduce", flat, op, "reduce of {} x {} to rank {}", flat.size, flat.dtype, root, root=root)
        if work is flat and self.rank != root:
            work = flat.copy()
        if sizes.direct(flat.nbytes, self.size):
            reduce_algos.direct_reduce(ctx, work, root, op)
        else:
            reduce_algos.ring_reduce(ctx, work, root, op)
        return work

    def all_gather(self, outputs: Sequence[np.ndarray], array: np.ndarray) -> None:
        small = self.small
        if small is not None and array.nbytes <= small.slot_bytes:
            shm_small.all_gather(small, self.take_seq(), [o.reshape(-1) for o in outputs], array.reshape(-1),
                                 _word(_ALL_GATHER, array))
            return
        ctx = self.context("all_gather", array, None, "all_gather of {} x {}", array.size, array.dtype)
        if sizes.all_gather_rings(array.nbytes):
            gather_algos.ring_all_gather(ctx, outputs, array)
        else:
            gather_algos.all_gather(ctx, outputs, array)

    def gather(self, outputs: Optional[Sequence[np.ndarray]], array: np.ndarray, root: int) -> None:
        small = self.small
        if small is not None and array.nbytes <= small.slot_bytes:
            flat_outputs = [o.reshape(-1) for o in outputs] if outputs is not None else None
            shm_small.gather(small, self.take_seq(), flat_outputs, array.reshape(-1), root,
                             _word(_GATHER, array, root))
            return
        ctx = self.context("gather", array, None, "gather of {} x {} to rank {}", array.size, array.dtype, root,
                           root=root)
        gather_algos.gather(ctx, outputs, array, root)

    def scatter(self, output: np.ndarray, inputs: Optional[Sequence[np.ndarray]], root: int) -> None:
        small = self.small
        if small is not None and output.nbytes * self.size <= small.slot_bytes:
            pieces = [i.reshape(-1) for i in inputs] if inputs is not None else None
            shm_small.scatter(small, self.take_seq(), output.reshape(-1), pieces, root,
                              _word(_SCATTER, output, root))
            return
        ctx = self.context("scatter", output, None, "scatter of {} x {} from rank {}", output.size, output.dtype,
                           root, root=root)
        gather_algos.scatter(ctx, output, inputs, root)

    def reduce_scatter(self, output: np.ndarray, parts: List[np.ndarray], op: ReduceOp) -> None:
        """``parts[k]`` (prepared): this rank's contribution to rank k's ``output``."""
        small = self.small
        if small is not None and output.nbytes * self.size <= small.slot_bytes:
            word, combine = self.reduction(_REDUCE_SCATTER, op, output.dtype)
            shm_small.reduce_scatter(small, self.take_seq(), parts, output.reshape(-1), combine, word)
            return
        ctx = self.context("reduce_scatter", output, op, "reduce_scatter of {} x {}", output.size, output.dtype)
        reduce_algos.direct_reduce_scatter(ctx, parts, output, op)

    def reduce_scatter_into(self, output: np.ndarray, flat: np.ndarray, op: ReduceOp) -> None:
        """``flat`` (not prepared) holds every rank's part in order."""
        m = output.size
        small = self.small
        if small is not None and output.nbytes * self.size <= small.slot_bytes:
            self.reduce_scatter(output, self._parts(flat, m, op), op)
            return
        ctx = self.context("reduce_scatter", output, op, "reduce_scatter of {} x {}", output.size, output.dtype)
        if sizes.direct(output.nbytes, self.size):
            reduce_algos.direct_reduce_scatter(ctx, self._parts(flat, m, op), output, op)
        else:
            work = prepare_input(op, flat)
            reduce_algos.ring_reduce_scatter_into(ctx, work.copy() if work is flat else work, output, op)

    def _parts(self, flat: np.ndarray, m: int, op: ReduceOp) -> List[np.ndarray]:
        return [prepare_input(op, flat[k * m:(k + 1) * m]) for k in range(self.size)]

    def all_to_all(self, outputs: Sequence[memoryview], inputs: Sequence[memoryview], array: Optional[np.ndarray],
                   what: str) -> None:
        """Byte views (``array``: one of the inputs, for the frames' dtype and count); always
        over the mesh: the channel carries no all_to_all."""
        ctx = self.context("all_to_all", array, None, what)
        gather_algos.all_to_all(ctx, outputs, inputs)

    def barrier(self) -> None:
        small = self.small
        if small is not None:
            shm_small.barrier(small, self.take_seq(), _BARRIER_WORD)
            return
        gather_algos.barrier(self.context("barrier", None, None, "barrier"))

    def monitored_barrier(self, timeout_s: float, wait_all_ranks: bool) -> None:
        """Rank 0 waits up to ``timeout_s`` for each rank, then names those that did not come
        (over the mesh: it takes an operation's number in a group of one too)."""
        ctx = self.context("monitored_barrier", None, None, "monitored_barrier")
        if self.size > 1:
            p2p.monitored_barrier(ctx, timeout_s, wait_all_ranks)

