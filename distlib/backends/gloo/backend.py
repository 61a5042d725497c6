"""The ``gloo`` backend: distlib's own CPU collectives, registered under the name users write.

It is not Facebook's gloo (a pure-Python backend cannot join a gloo group; it only shares the
store); it does the same job: a full TCP mesh between the group's ranks (transport/tcp.py),
shared memory between ranks of one host (transport/shm.py), and an algorithm per collective
and size (algorithms/). Setting up is backends/gloo_setup.py; this module routes each
collective by its route table (backends/gloo_routes.py): through the small-collective channel
(transport/shm_channel.py) when every rank's part fits its slot, all_reduce of large arrays
through a shared segment set up on its first use (backends/shared_segments.py), everything
else over the mesh.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from functools import partial
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ... import settings
from .algorithms import gather as gather_algos
from .algorithms import p2p
from .algorithms.context import Label, OpContext, bview
from .algorithms.shm_allreduce import ShmAllReduce
from ...arrays import DTYPE_CODES as _DTYPES
from ...arrays import device_of, dtype_code
from ...deadline import Deadline
from ...errors import DistBackendError
from ...reduce_op import ReduceOp, finish, kernel, prepare_input
from .transport import frames
from .transport import shm_channel
from .transport.shm_channel import SmallChannel
from .transport.tcp import Mesh
from .. import cuda_staging
from ..base import CommBackend, RecvHandle
from . import routes
from .group_setup import connect_group, small_channel
from .shared_segments import LargeSegment, agree_on_segment

log = logging.getLogger("distlib.backends.gloo")

#: all_reduce of at least this many bytes per rank uses shared memory (all ranks local) in
#: rounds (algorithms/shm_allreduce.py); with a small channel, everything above its slot does.
SHM_MIN_BYTES = 256 << 10
#: Bytes per rank per round in the shared segment.
SHM_SLOT_BYTES = 8 << 20
_ALL_REDUCE = frames.OPS["all_reduce"]


class _P2PRecv(RecvHandle):
    def __init__(self, mesh: Mesh, slot, deadline: Deadline):
        self.mesh, self.slot, self.deadline = mesh, slot, deadline

    def wait(self) -> int:
        return self.mesh.wait(self.slot, self.deadline)

    def is_completed(self) -> bool:
        return self.slot.done


class GlooBackend(CommBackend):
    name = "gloo"

    def __init__(self, store, rank: int, size: int, timeout: timedelta, label: str = "gloo"):
        super().__init__(store, rank, size, timeout)
        self.timeout_s = timeout.total_seconds()
        self.label = label
        self.seq = 0
        self.meshes: List[Mesh] = []
        #: The large all_reduce's shared segment (set up on first use)
        self.large = LargeSegment(settings.shared_memory())
        self.small: Optional[SmallChannel] = None
        self._reductions: Dict[tuple, Tuple[int, Any]] = {}
        self.records: list = []
        self.all_local = False
        self.crowded = False
        try:
            self.records, self.all_local, self.crowded = connect_group(
                store, rank, size, self.timeout_s, label, Deadline(self.timeout_s), self.meshes)
            self.small = small_channel(self.op_context, rank, size, self.timeout_s, label, self.meshes[0],
                                       self.all_local)
        except BaseException:
            self.shutdown()
            raise

    # -- arrays and state ------------------------------------------------------------------------

    def for_array(self, array) -> CommBackend:
        """cupy arrays go through host memory (backends/cuda_staging.py), as torch's gloo does."""
        return cuda_staging.staged(self, array) if device_of(array) == "cuda" else self

    @property
    def shm_state(self) -> str:
        """Whether all_reduce goes through shared memory: "on" (the small channel, or the large
        segment once set up), "off" (it cannot), "unset" (no channel, and no large all_reduce yet)."""
        return "on" if self.small is not None else self.large.state

    # -- what the routes use (gloo_routes.py) ----------------------------------------------------

    def op_context(self, op_name: str, array: Optional[np.ndarray], redop: Optional[ReduceOp], what: str,
                   *args, root: int = -1, announce: bool = True) -> OpContext:
        """The next operation's context, for an operation that goes over the mesh (and, in a
        group with a small-collective channel, announced there: see shm_channel).
        ``what.format(*args)`` names it in errors (formatted only then)."""
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

    def reduction(self, code: int, op: ReduceOp, dtype: np.dtype, root: int = -1) -> Tuple[int, Any]:
        """(descriptor word, ufunc) of a reduction through the channel, kept: working them out
        costs about a tenth of a small all_reduce."""
        key = (code, op.op, dtype, root)
        found = self._reductions.get(key)
        if found is None:
            word = shm_channel.descriptor(code, _DTYPES.get(dtype, 0), op.code, root)
            found = self._reductions[key] = (word, kernel(op, dtype))
        return found

    # -- collectives: each goes the way its route table says (gloo_routes.py) --------------------

    def route(self, nbytes: int, segment_for: Optional[Tuple[np.ndarray, ReduceOp]] = None) -> str:
        """Where the next collective goes, each rank's part being ``nbytes``: SMALL when the
        small channel holds it, SEGMENT for an all_reduce (``segment_for``: its array and op)
        that the large shared segment takes, else MESH."""
        small = self.small
        if small is not None and nbytes <= small.slot_bytes:
            return routes.SMALL
        if segment_for is not None and self._use_segment(*segment_for):
            return routes.SEGMENT
        return routes.MESH

    def all_reduce(self, array: np.ndarray, op: ReduceOp) -> None:
        flat = array.reshape(-1)
        if op.factor is not None:
            flat[...] = prepare_input(op, flat)
        if self.size > 1:
            routes.ALL_REDUCE[self.route(flat.nbytes, (flat, op))](self, flat, op)
        finish(op, flat, self.size)

    def _use_segment(self, flat: np.ndarray, op: ReduceOp) -> bool:
        """Whether a large all_reduce goes through the shared segment (set up on first use,
        before the operation's own context is made: the setup is operations of its own)."""
        least = self.small.slot_bytes + 1 if self.small is not None else SHM_MIN_BYTES
        if not self.all_local or flat.nbytes < least or not self.large.may_use():
            return False
        if not self.large.tried:
            if self.small is not None:  # a rank waiting in the channel sees the all_reduce, not the setup
                word = shm_channel.descriptor(_ALL_REDUCE, _DTYPES.get(flat.dtype, 0), op.code, -1)
                self.small.announce(shm_channel.stamp(self.seq), word, flat.size)
            segment = agree_on_segment(partial(self.op_context, announce=False), self.rank,
                                       ShmAllReduce.bytes_needed(self.size, SHM_SLOT_BYTES), "large all_reduce",
                                       self.label)
            self.large.set_up(segment, self.size, SHM_SLOT_BYTES)
        return self.large.all_reduce is not None

    def broadcast(self, array: np.ndarray, root: int) -> None:
        if self.size > 1:
            flat = array.reshape(-1)
            routes.BROADCAST[self.route(flat.nbytes)](self, flat, root)

    def reduce(self, array: np.ndarray, root: int, op: ReduceOp) -> None:
        flat = array.reshape(-1)
        work = prepare_input(op, flat) if op.factor is not None else flat
        if self.size > 1:
            work = routes.REDUCE[self.route(flat.nbytes)](self, flat, work, root, op)
        if self.rank == root:
            if work is not flat:
                flat[...] = work
            finish(op, flat, self.size)

    def all_gather(self, outputs: Sequence[np.ndarray], array: np.ndarray) -> None:
        routes.ALL_GATHER[self.route(array.nbytes)](self, outputs, array)

    def all_gather_into(self, output: np.ndarray, array: np.ndarray) -> None:
        flat = output.reshape(-1)
        self.all_gather([flat[k * array.size:(k + 1) * array.size] for k in range(self.size)], array)

    def gather(self, outputs, array: np.ndarray, root: int) -> None:
        routes.GATHER[self.route(array.nbytes)](self, outputs, array, root)

    def scatter(self, output: np.ndarray, inputs, root: int) -> None:
        routes.SCATTER[self.route(output.nbytes * self.size)](self, output, inputs, root)

    def reduce_scatter(self, output: np.ndarray, inputs: Sequence[np.ndarray], op: ReduceOp) -> None:
        parts = [prepare_input(op, a.reshape(-1)) for a in inputs]
        routes.REDUCE_SCATTER[self.route(output.nbytes * self.size)](self, output, parts, op)
        finish(op, output.reshape(-1), self.size)

    def reduce_scatter_into(self, output: np.ndarray, array: np.ndarray, op: ReduceOp) -> None:
        routes.REDUCE_SCATTER_INTO[self.route(output.nbytes * self.size)](self, output, array.reshape(-1), op)
        finish(op, output.reshape(-1), self.size)

    def all_to_all(self, outputs: Sequence[np.ndarray], inputs: Sequence[np.ndarray]) -> None:
        ref = inputs[0] if inputs else None
        ctx = self.op_context("all_to_all", ref, None, "all_to_all")
        gather_algos.all_to_all(ctx, [bview(o) for o in outputs], [bview(i) for i in inputs])

    def all_to_all_single(self, output: np.ndarray, array: np.ndarray,
                          output_splits: List[int], input_splits: List[int]) -> None:
        ctx = self.op_context("all_to_all", array, None, "all_to_all_single")
        row_out = int(np.prod(output.shape[1:])) if output.ndim > 1 else 1
        row_in = int(np.prod(array.shape[1:])) if array.ndim > 1 else 1
        outs = gather_algos.split_views(output.reshape(-1), output_splits, row_out)
        ins = gather_algos.split_views(array.reshape(-1), input_splits, row_in)
        gather_algos.all_to_all(ctx, outs, ins)

    def barrier(self) -> None:
        if self.size > 1:
            routes.BARRIER[self.route(0)](self)

    def monitored_barrier(self, timeout: timedelta, wait_all_ranks: bool) -> None:
        """Rank 0 waits up to ``timeout`` for each rank, then names those that did not come."""
        ctx = self.op_context("monitored_barrier", None, None, "monitored_barrier")
        if self.size > 1:
            p2p.monitored_barrier(ctx, timeout.total_seconds(), wait_all_ranks)

    # -- point to point --------------------------------------------------------------------------

    def send(self, array: np.ndarray, dst: int, tag: int) -> None:
        p2p.send(self.meshes[0], array, dtype_code(array.dtype), dst, tag, Deadline(self.timeout_s),
                 f"send of {array.size} x {array.dtype} to rank {dst} (tag {tag})")

    def post_recv(self, array: np.ndarray, src: Optional[int], tag: int) -> RecvHandle:
        what = f"recv of {array.size} x {array.dtype} (tag {tag})"
        slot = p2p.post_recv(self.meshes[0], array, dtype_code(array.dtype), src, tag, what)
        return _P2PRecv(self.meshes[0], slot, Deadline(self.timeout_s))

    # -- teardown --------------------------------------------------------------------------------

    def shutdown(self) -> None:
        for mesh in self.meshes:
            mesh.close()
        self.meshes = []
        if self.small is not None:
            self.small.close()
            self.small = None
        self.large.close()

    def abort(self, reason: str) -> None:
        for mesh in self.meshes:
            mesh.abort(DistBackendError(reason))
