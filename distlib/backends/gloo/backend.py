"""The ``gloo`` backend: distlib's own CPU collectives, registered under the name users write.

It is not Facebook's gloo (a pure-Python backend cannot join a gloo group; it only shares the
store); it does the same job: a full TCP mesh between the group's ranks (transport/tcp.py),
shared memory between ranks of one host (transport/shm.py), and an algorithm per collective
and size (algorithms/). Setting up is group_setup.py; where each collective goes is the
router's (router.py: the small channel, the shared segment or the mesh). This module does
what every route shares: the reduce op's arithmetic before and after (AVG, PREMUL_SUM), the
group of one, point-to-point messages, teardown, and refusing every operation of a group
that failed (Router.refusal: a group stays aborted until it is destroyed), before it touches
the caller's arrays.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import List, Optional, Sequence

import numpy as np

from ... import settings
from ...arrays import device_of, dtype_code
from ...deadline import Deadline
from ...errors import DistBackendError
from ...identity import Identity
from ...reduce_op import ReduceOp, finish, prepare_input
from .. import cuda_staging
from ..base import CommBackend, RecvHandle
from . import sizes
from .algorithms import gather as gather_algos
from .algorithms import p2p
from .algorithms.context import bview
from .group_setup import connect_group, small_channel
from .router import Router, close
from .shared_segments import LargeSegment
from .transport.matching import Slot
from .transport.shm_channel import SmallChannel
from .transport.tcp import Mesh

log = logging.getLogger("distlib.backends.gloo")


class _P2PRecv(RecvHandle):
    def __init__(self, mesh: Mesh, slot: Slot, deadline: Deadline):
        self.mesh, self.slot, self.deadline = mesh, slot, deadline

    def wait(self) -> int:
        return self.mesh.wait(self.slot, self.deadline)

    def is_completed(self) -> bool:
        return self.slot.done


class GlooBackend(CommBackend):
    name = "gloo"

    def __init__(self, store, rank: int, size: int, timeout: timedelta, label: str = "gloo",
                 identity: Identity = Identity()):
        super().__init__(store, rank, size, timeout)
        self.timeout_s = timeout.total_seconds()
        self.label = label
        meshes: List[Mesh] = []
        large = LargeSegment(settings.shared_memory())
        self.records: list = []
        try:
            self.records, all_local, crowded = connect_group(
                store, rank, size, self.timeout_s, label, Deadline(self.timeout_s), meshes, identity)
        except BaseException:
            close(meshes, None, large)
            raise
        self.router = Router(rank, size, meshes, large, all_local, crowded, self.timeout_s, label)
        try:
            self.router.use_channel(small_channel(self.router.context, rank, size, sizes.small_slot_bytes(size),
                                                  self.timeout_s, label, meshes[0], all_local))
        except BaseException:
            self.router.close()
            raise

    # -- arrays and state ------------------------------------------------------------------------

    def for_array(self, array) -> CommBackend:
        """cupy arrays go through host memory (backends/cuda_staging.py), as torch's gloo does."""
        return cuda_staging.staged(self, array) if device_of(array) == "cuda" else self

    @property
    def meshes(self) -> List[Mesh]:
        """The group's meshes (one per GLOO_SOCKET_IFNAME interface; p2p uses the first)."""
        return self.router.meshes

    @property
    def small(self) -> Optional[SmallChannel]:
        """The small-collective channel, or None (not every rank on this host, or DISTLIB_SHM=0)."""
        return self.router.small

    @property
    def shm_state(self) -> str:
        """Whether all_reduce goes through shared memory: "on", "off" or "unset" (Router.shm_state)."""
        return self.router.shm_state

    # -- collectives: the router says which way each goes ----------------------------------------

    def all_reduce(self, array: np.ndarray, op: ReduceOp) -> None:
        if self.router.failure is not None:
            raise self.router.refusal()
        flat = array.reshape(-1)
        if op.factor is not None:
            flat[...] = prepare_input(op, flat)
        if self.size > 1:
            self.router.all_reduce(flat, op)
        finish(op, flat, self.size)

    def broadcast(self, array: np.ndarray, root: int) -> None:
        if self.router.failure is not None:
            raise self.router.refusal()
        if self.size > 1:
            self.router.broadcast(array.reshape(-1), root)

    def reduce(self, array: np.ndarray, root: int, op: ReduceOp) -> None:
        if self.router.failure is not None:
            raise self.router.refusal()
        flat = array.reshape(-1)
        work = prepare_input(op, flat) if op.factor is not None else flat
        if self.size > 1:
            work = self.router.reduce(flat, work, root, op)
        if self.rank == root:
            if work is not flat:
                flat[...] = work
            finish(op, flat, self.size)

    def all_gather(self, outputs: Sequence[np.ndarray], array: np.ndarray) -> None:
        if self.router.failure is not None:
            raise self.router.refusal()
        self.router.all_gather(outputs, array)

    def all_gather_into(self, output: np.ndarray, array: np.ndarray) -> None:
        flat = output.reshape(-1)
        self.all_gather([flat[k * array.size:(k + 1) * array.size] for k in range(self.size)], array)

    def gather(self, outputs, array: np.ndarray, root: int) -> None:
        if self.router.failure is not None:
            raise self.router.refusal()
        self.router.gather(outputs, array, root)

    def scatter(self, output: np.ndarray, inputs, root: int) -> None:
        if self.router.failure is not None:
            raise self.router.refusal()
        self.router.scatter(output, inputs, root)

    def reduce_scatter(self, output: np.ndarray, inputs: Sequence[np.ndarray], op: ReduceOp) -> None:
        if self.router.failure is not None:
            raise self.router.refusal()
        self.router.reduce_scatter(output, [prepare_input(op, a.reshape(-1)) for a in inputs], op)
        finish(op, output.reshape(-1), self.size)

    def reduce_scatter_into(self, output: np.ndarray, array: np.ndarray, op: ReduceOp) -> None:
        if self.router.failure is not None:
            raise self.router.refusal()
        self.router.reduce_scatter_into(output, array.reshape(-1), op)
        finish(op, output.reshape(-1), self.size)

    def all_to_all(self, outputs: Sequence[np.ndarray], inputs: Sequence[np.ndarray]) -> None:
        if self.router.failure is not None:
            raise self.router.refusal()
        self.router.all_to_all([bview(o) for o in outputs], [bview(i) for i in inputs],
                               inputs[0] if inputs else None, "all_to_all")

    def all_to_all_single(self, output: np.ndarray, array: np.ndarray,
                          output_splits: List[int], input_splits: List[int]) -> None:
        if self.router.failure is not None:
            raise self.router.refusal()
        row_out = int(np.prod(output.shape[1:])) if output.ndim > 1 else 1
        row_in = int(np.prod(array.shape[1:])) if array.ndim > 1 else 1
        outs = gather_algos.split_views(output.reshape(-1), output_splits, row_out)
        ins = gather_algos.split_views(array.reshape(-1), input_splits, row_in)
        self.router.all_to_all(outs, ins, array, "all_to_all_single")

    def barrier(self) -> None:
        if self.router.failure is not None:
            raise self.router.refusal()
        if self.size > 1:
            self.router.barrier()

    def monitored_barrier(self, timeout: timedelta, wait_all_ranks: bool) -> None:
        """Rank 0 waits up to ``timeout`` for each rank, then names those that did not come."""
        if self.router.failure is not None:
            raise self.router.refusal()
        self.router.monitored_barrier(timeout.total_seconds(), wait_all_ranks)

    # -- point to point --------------------------------------------------------------------------

    def send(self, array: np.ndarray, dst: int, tag: int) -> None:
        if self.router.failure is not None:
            raise self.router.refusal()
        p2p.send(self.meshes[0], array, dtype_code(array.dtype), dst, tag, Deadline(self.timeout_s),
                 f"send of {array.size} x {array.dtype} to rank {dst} (tag {tag})")

    def post_recv(self, array: np.ndarray, src: Optional[int], tag: int) -> RecvHandle:
        if self.router.failure is not None:
            raise self.router.refusal()
        what = f"recv of {array.size} x {array.dtype} (tag {tag})"
        slot = p2p.post_recv(self.meshes[0], array, dtype_code(array.dtype), src, tag, what)
        return _P2PRecv(self.meshes[0], slot, Deadline(self.timeout_s))

    # -- teardown --------------------------------------------------------------------------------

    def shutdown(self) -> None:
        self.router.close()

    def abort(self, reason: Optional[str] = None) -> None:
        """torch's Backend.abort(): every rank is told (an ABORT frame), and every pending and
        later operation on the group fails with the reason."""
        error = DistBackendError(f"{self.label}: rank {self.rank}: the process group was aborted"
                                 f"{f' ({reason})' if reason else ''}")
        for mesh in self.meshes:
            mesh.abort(error)
