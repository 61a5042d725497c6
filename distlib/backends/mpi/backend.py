"""The ``mpi`` backend: every collective on MPI's own collectives, through mpi4py.

Each operation is one call of MPI's matching collective (MPI_Allreduce, MPI_Bcast,
MPI_Reduce, MPI_Allgather, MPI_Gather, MPI_Scatter, MPI_Reduce_scatter_block,
MPI_Alltoallv, MPI_Barrier) or point-to-point call (MPI_Isend, MPI_Irecv), so the MPI
library's tuned algorithms and its shared-memory transport do the work; distlib adds what
torch's ProcessGroupMPI does not have: reduce_scatter, the ``*_tensor`` variants, AVG,
PREMUL_SUM, the bitwise ops, bool and float16 (ops.py). List arguments (all_gather's
outputs, scatter's inputs, ...) are staged through one contiguous buffer, since MPI
collectives take one buffer per rank.

Rank and size come from MPI_COMM_WORLD (runtime.py); no store is used. The default
group's communicator is a duplicate of MPI_COMM_WORLD, so the program's own mpi4py traffic
never meets distlib's; a ``new_group`` is ``MPI_Comm_create_group`` over its members only
(non-members take no part, so ``use_local_synchronization`` works too). monitored_barrier
runs on a second duplicate, with point-to-point messages that rank 0 can stop waiting for.

Every blocking call has the group's timeout (watchdog.py: past it the job is aborted
with a message saying what was waited for, since an MPI call cannot be cancelled). An error
MPI reports is raised as DistBackendError naming the operation and MPI's error text; in a
collective, the group stays failed on that rank: every later operation on it is refused at
once, naming that error, until it is destroyed. MPI reports a mismatch (MPI_ERR_TRUNCATE) only on the ranks that
receive more than they posted, and cannot tell the others; a rank that then waits for a rank
that refuses the group is ended by its watchdog, whose message says so, and why (each rank
answers the watchdog's question with the groups it refuses).
"""

from __future__ import annotations

import socket
import threading
import time
from datetime import timedelta
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ...arrays import device_of
from ...deadline import Deadline, format_duration
from ...errors import DistBackendError
from ...reduce_op import ReduceOp, finish, prepare_input
from .. import cuda_staging
from ..base import CommBackend, RecvHandle, refused_after_failure
from ..monitored_barrier import not_passed, told_failed
from . import runtime as mpi_runtime
from .ops import OpTable
from .watchdog import WATCHDOG, describe

#: Tag of MPI_Comm_create_group (only new_group's members take part, in the same order).
_CREATE_TAG = 7411

_tables: Dict[int, OpTable] = {}


def _op_table(MPI) -> OpTable:  # noqa: N803 - the module's own name
    table = _tables.get(id(MPI))
    if table is None:
        table = _tables[id(MPI)] = OpTable(MPI)
    return table


def _ranges(ranks: Sequence[int]) -> str:
    """``0-3, 7`` for [0, 1, 2, 3, 7]."""
    parts: List[str] = []
    run: Optional[Tuple[int, int]] = None  # (first, last) of the consecutive ranks so far
    for r in ranks:
        if run is not None and r == run[1] + 1:
            run = (run[0], r)
            continue
        if run is not None:
            parts.append(str(run[0]) if run[0] == run[1] else f"{run[0]}-{run[1]}")
        run = (r, r)
    if run is not None:
        parts.append(str(run[0]) if run[0] == run[1] else f"{run[0]}-{run[1]}")
    return ", ".join(parts)


class _Request(RecvHandle):
    """An MPI_Isend or MPI_Irecv: ``wait()`` returns the peer's group rank."""

    def __init__(self, backend: "MPIBackend", request, op: str, array: np.ndarray, peer: Optional[int], tag: int):
        self.backend, self.request, self.op, self.array, self.peer, self.tag = backend, request, op, array, peer, tag
        self._lock = threading.Lock()  # MPI forbids two threads waiting on one request
        self._done = False
        self._error: Optional[DistBackendError] = None
        self._source = peer

    def _what(self) -> str:
        who = "any rank" if self.peer is None else f"rank {self.peer}"
        return f"{'to' if self.op == 'send' else 'from'} {who} (tag {self.tag})"

    def wait(self) -> int:
        with self._lock:
            if not self._done:
                status = self.backend.MPI.Status()
                self.backend._call(self.op, f"of {self.array.size} x {self.array.dtype} {self._what()}",
                                   self.request.Wait, status)
                self._finish(status)
        if self._error is not None:
            raise self._error
        assert self._source is not None, "a finished receive knows its sender (_finish)"
        return self._source

    def is_completed(self) -> bool:
        if self._done:
            return True
        if not self._lock.acquire(blocking=False):
            return False  # another thread is waiting on it
        try:
            if not self._done:
                status = self.backend.MPI.Status()
                if self.request.Test(status):
                    self._finish(status)
        finally:
            self._lock.release()
        return self._done

    def _finish(self, status) -> None:
        self._done = True
        if self.op == "recv":
            self._source = status.Get_source()
            got = status.Get_count(self.backend.ops.datatype(self.array.dtype))
            if got != self.array.size:
                self._error = DistBackendError(
                    f"{self.backend.label}: rank {self.backend.rank}: recv of {self.array.size} x {self.array.dtype} "
                    f"from rank {self._source} (tag {self.tag}) got {got} elements: the sender sent a different size")


class MPIBackend(CommBackend):
    """One process group's collectives on an MPI communicator."""

    name = "mpi"

    def __init__(self, rank: int, size: int, timeout: timedelta, global_ranks: List[int], label: str = "mpi"):
        super().__init__(None, rank, size, timeout)
        self.MPI = mpi_runtime.mpi()
        self.ops = _op_table(self.MPI)
        self.label = label
        self.timeout_s = timeout.total_seconds()
        self.global_ranks = list(global_ranks)
        self.seq = 0
        self.hosts: Optional[List[str]] = None
        # mpi4py communicators (MPI.Intracomm; the module is loaded at run time): set by _establish
        self.comm: Any = None
        self.control: Any = None
        self._monitor_seq = 0
        self._closed = False
        #: The group's first failure (an error MPI reported): every later operation is refused
        self.failure: Optional[BaseException] = None
        try:
            self._establish()
        except BaseException:
            self.shutdown()
            raise

    def for_array(self, array) -> CommBackend:
        """cupy arrays go through host memory (backends/cuda_staging.py), as on gloo: the
        wheel's Open MPI is not CUDA-aware, and staging works with every MPI."""
        return cuda_staging.staged(self, array) if device_of(array) == "cuda" else self

    # -- setting up ------------------------------------------------------------------------------

    def _establish(self) -> None:
        parent = self._call("init", "(duplicating MPI_COMM_WORLD)", mpi_runtime.parent_communicator)
        if self.global_ranks == list(range(parent.Get_size())):
            self.comm = self._call("init", "(duplicating MPI_COMM_WORLD)", parent.Dup)
        else:
            group = parent.Get_group().Incl(self.global_ranks)
            try:
                self.comm = self._call("new_group", f"(MPI_Comm_create_group of ranks {_ranges(self.global_ranks)})",
                                       parent.Create_group, group, _CREATE_TAG)
            finally:
                group.Free()
        if (self.comm.Get_rank(), self.comm.Get_size()) != (self.rank, self.size):
            raise DistBackendError(
                f"{self.label}: the group's rendezvous made this process rank {self.rank} of {self.size}, but in MPI "
                f"it is rank {self.comm.Get_rank()} of {self.comm.Get_size()}: launch with mpirun and let "
                f"init_process_group('mpi') take rank and size from MPI")
        WATCHDOG.answer_questions_with(self.MPI, mpi_runtime.diagnostics_communicator())
        self.control = self._call("init", "(duplicating the group's communicator)", self.comm.Dup)
        self.hosts = self._call("init", "(exchanging host names)", self.control.allgather, socket.gethostname())
        self.tag_ub = self.comm.Get_attr(self.MPI.TAG_UB)

    def describe_group(self) -> str:
        """``group pg0/mpi (ranks 0-1 on node-a, 2-3 on node-b)``: for error messages."""
        if not self.hosts:
            return f"group {self.label} (ranks {_ranges(self.global_ranks)})"
        by_host: Dict[str, List[int]] = {}
        for global_rank, host in zip(self.global_ranks, self.hosts, strict=False):
            by_host.setdefault(host, []).append(global_rank)
        where = ", ".join(f"{_ranges(ranks)} on {host}" for host, ranks in by_host.items())
        return f"group {self.label} (ranks {where})"

    # -- helpers ---------------------------------------------------------------------------------

    def _call(self, op: str, detail, fn, *args):
        """``fn(*args)``, a blocking MPI call, under the watchdog's deadline."""
        token = WATCHDOG.begin(self.timeout_s, op, detail, self)
        try:
            return fn(*args)
        except self.MPI.Exception as exc:
            error = DistBackendError(f"{self.label}: rank {self.rank}: {describe(op, detail)} failed in MPI: "
                                     f"{exc.Get_error_string()}")
            if self.control is not None and op not in ("send", "recv"):
                # a collective of the group failed (not its making, nor a message of another size,
                # which leaves MPI's matching of the group's collectives as it was)
                self._failed(error)
            raise error from None
        finally:
            WATCHDOG.end(token)

    def _failed(self, error: BaseException) -> None:
        """The group fails (once): every later operation is refused, and the watchdog tells any
        rank that asks (mpi/watchdog.py)."""
        if self.failure is None:
            self.failure = error
            WATCHDOG.group_failed(self.label, str(error))

    def _check_usable(self) -> None:
        if self.failure is not None:
            raise refused_after_failure(self.label, self.rank, self.failure)

    def _begin(self, *arrays) -> None:
        """Count the collective (ranks count alike: a timeout error compares their numbers);
        refuse arrays MPI cannot take from here, and every operation of a group that failed."""
        if self.failure is not None:
            raise refused_after_failure(self.label, self.rank, self.failure)
        self._numpy(*arrays)
        self.seq += 1

    @staticmethod
    def _numpy(*arrays) -> None:
        """Refuse arrays MPI cannot take (cupy arrays arrive here as host copies, see for_array)."""
        for array in arrays:
            if not isinstance(array, np.ndarray):
                raise TypeError(
                    f"the mpi backend takes numpy arrays (and cupy arrays, through host memory); got "
                    f"{type(array).__module__}.{type(array).__name__}")

    def _buf(self, array: np.ndarray):
        return [array, self.ops.datatype(array.dtype)]

    @staticmethod
    def _flat(array: np.ndarray) -> np.ndarray:
        return array.reshape(-1)

    # -- collectives -----------------------------------------------------------------------------

    def broadcast(self, array: np.ndarray, root: int) -> None:
        self._begin(array)
        self._call("broadcast", array, self.comm.Bcast, self._buf(array), root)

    def all_reduce(self, array: np.ndarray, op: ReduceOp) -> None:
        self._begin(array)
        flat = self._flat(array)
        if op.factor is not None:
            flat[...] = prepare_input(op, flat)
        datatype, mpi_op = self.ops.reduction(flat.dtype, op)
        self._call("all_reduce", flat, self.comm.Allreduce, self.MPI.IN_PLACE, [flat, datatype], mpi_op)
        finish(op, flat, self.size)

    def reduce(self, array: np.ndarray, root: int, op: ReduceOp) -> None:
        self._begin(array)
        flat = self._flat(array)
        datatype, mpi_op = self.ops.reduction(flat.dtype, op)
        if self.rank == root:
            if op.factor is not None:
                flat[...] = prepare_input(op, flat)
            self._call("reduce", flat, self.comm.Reduce, self.MPI.IN_PLACE, [flat, datatype], mpi_op, root)
            finish(op, flat, self.size)
        else:
            contribution = prepare_input(op, flat)  # non-roots' arrays are left as they were
            self._call("reduce", flat, self.comm.Reduce, [contribution, datatype], None, mpi_op, root)

    def all_gather(self, outputs: Sequence[np.ndarray], array: np.ndarray) -> None:
        self._begin(array, *outputs)
        staged = np.empty(array.size * self.size, array.dtype)
        self._call("all_gather", array, self.comm.Allgather, self._buf(array), self._buf(staged))
        for k, out in enumerate(outputs):
            self._flat(out)[...] = staged[k * array.size:(k + 1) * array.size]

    def all_gather_into(self, output: np.ndarray, array: np.ndarray) -> None:
        self._begin(output, array)
        self._call("all_gather_into_tensor", array, self.comm.Allgather, self._buf(array), self._buf(output))

    def gather(self, outputs: Optional[Sequence[np.ndarray]], array: np.ndarray, root: int) -> None:
        self._begin(array, *(outputs or ()))
        if self.rank != root:
            self._call("gather", array, self.comm.Gather, self._buf(array), None, root)
            return
        assert outputs is not None, "the root's outputs (collectives.gather checks them)"
        staged = np.empty(array.size * self.size, array.dtype)
        self._call("gather", array, self.comm.Gather, self._buf(array), self._buf(staged), root)
        for k, out in enumerate(outputs):
            self._flat(out)[...] = staged[k * array.size:(k + 1) * array.size]

    def scatter(self, output: np.ndarray, inputs: Optional[Sequence[np.ndarray]], root: int) -> None:
        self._begin(output, *(inputs or ()))
        staged = None
        if self.rank == root:
            assert inputs is not None, "the root's inputs (collectives.scatter checks them)"
            staged = self._buf(np.concatenate([self._flat(a) for a in inputs]))
        self._call("scatter", output, self.comm.Scatter, staged, self._buf(output), root)

    def reduce_scatter(self, output: np.ndarray, inputs: Sequence[np.ndarray], op: ReduceOp) -> None:
        self._begin(output, *inputs)
        staged = np.concatenate([self._flat(prepare_input(op, a)) for a in inputs])
        datatype, mpi_op = self.ops.reduction(output.dtype, op)
        self._call("reduce_scatter", output, self.comm.Reduce_scatter_block, [staged, datatype],
                   [output, datatype], mpi_op)
        finish(op, self._flat(output), self.size)

    def reduce_scatter_into(self, output: np.ndarray, array: np.ndarray, op: ReduceOp) -> None:
        self._begin(output, array)
        contribution = prepare_input(op, self._flat(array))
        datatype, mpi_op = self.ops.reduction(output.dtype, op)
        self._call("reduce_scatter_tensor", output, self.comm.Reduce_scatter_block, [contribution, datatype],
                   [output, datatype], mpi_op)
        finish(op, self._flat(output), self.size)

    def all_to_all(self, outputs: Sequence[np.ndarray], inputs: Sequence[np.ndarray]) -> None:
        self._begin(*inputs, *outputs)
        dtype = inputs[0].dtype
        send_counts = [a.size for a in inputs]
        recv_counts = [a.size for a in outputs]
        staged_in = np.concatenate([self._flat(a) for a in inputs]) if inputs else np.empty(0, dtype)
        staged_out = np.empty(sum(recv_counts), dtype)
        self._alltoallv("all_to_all", staged_in, send_counts, staged_out, recv_counts)
        offset = 0
        for out, count in zip(outputs, recv_counts, strict=True):
            self._flat(out)[...] = staged_out[offset:offset + count]
            offset += count

    def all_to_all_single(self, output: np.ndarray, array: np.ndarray,
                          output_splits: List[int], input_splits: List[int]) -> None:
        self._begin(output, array)
        row_out = int(np.prod(output.shape[1:])) if output.ndim > 1 else 1
        row_in = int(np.prod(array.shape[1:])) if array.ndim > 1 else 1
        self._alltoallv("all_to_all_single", self._flat(array), [s * row_in for s in input_splits],
                        self._flat(output), [s * row_out for s in output_splits])

    def _alltoallv(self, op: str, send: np.ndarray, send_counts: List[int], recv: np.ndarray,
                   recv_counts: List[int]) -> None:
        datatype = self.ops.datatype(send.dtype)
        send_displs = np.concatenate([[0], np.cumsum(send_counts)[:-1]]).astype(np.int64).tolist()
        recv_displs = np.concatenate([[0], np.cumsum(recv_counts)[:-1]]).astype(np.int64).tolist()
        self._call(op, send, self.comm.Alltoallv, [send, (send_counts, send_displs), datatype],
                   [recv, (recv_counts, recv_displs), datatype])

    def barrier(self) -> None:
        self._begin()
        self._call("barrier", "", self.comm.Barrier)

    def monitored_barrier(self, timeout: timedelta, wait_all_ranks: bool) -> None:
        """Rank 0 waits up to ``timeout`` for each rank's message, then names those that did
        not come; the others wait for rank 0's verdict. Point-to-point on the control
        communicator, so rank 0 can stop waiting (a collective could not be left)."""
        self._begin()
        self._monitor_seq += 1
        tag = self._monitor_seq % self.tag_ub
        if self.size == 1:
            return
        MPI, seconds = self.MPI, timeout.total_seconds()
        verdict = np.zeros(1, np.int8)
        if self.rank != 0:
            self._call("monitored_barrier", "(arriving at rank 0)", self.control.Send, [verdict, MPI.INT8_T], 0, tag)
            request = self.control.Irecv([verdict, MPI.INT8_T], 0, tag)
            if not self._poll(request, Deadline(seconds + 5.0)):
                raise DistBackendError(f"monitored_barrier: rank {self.rank} had no verdict from rank 0 within "
                                       f"{format_duration(seconds + 5.0)}")
            if verdict[0]:
                raise told_failed(seconds)
            return
        arrivals = {r: self.control.Irecv([np.zeros(1, np.int8), MPI.INT8_T], r, tag) for r in range(1, self.size)}
        limit = Deadline(seconds)
        failed = []
        for r, request in arrivals.items():
            if not self._poll(request, limit):
                failed.append(r)
                if not wait_all_ranks:
                    break
        verdict[0] = 1 if failed else 0
        for r in range(1, self.size):  # the late ranks too: one byte goes out eagerly, and they learn at once
            self._call("monitored_barrier", f"(verdict to rank {r})", self.control.Send, [verdict, MPI.INT8_T], r, tag)
        if failed:
            raise not_passed(failed, seconds, wait_all_ranks)

    def _poll(self, request, deadline: Deadline) -> bool:
        """Test ``request`` until it completes (True) or ``deadline`` passes (False: cancelled)."""
        pause = 0.0001
        while True:
            if request.Test():
                return True
            if deadline.expired():
                request.Cancel()
                request.Wait()  # a cancelled receive completes at once
                return False
            time.sleep(min(pause, deadline.remaining()))
            pause = min(pause * 2, 0.01)

    # -- point to point --------------------------------------------------------------------------

    def _check_tag(self, tag: int) -> None:
        if tag > self.tag_ub:
            raise ValueError(f"tag {tag} is above this MPI's MPI_TAG_UB ({self.tag_ub}): the mpi backend takes tags "
                             f"0..{self.tag_ub}")

    def post_send(self, array: np.ndarray, dst: int, tag: int) -> RecvHandle:
        self._check_usable()
        self._numpy(array)
        self._check_tag(tag)
        request = self.comm.Isend(self._buf(array), dst, tag)
        return _Request(self, request, "send", array, dst, tag)

    def send(self, array: np.ndarray, dst: int, tag: int) -> None:
        self.post_send(array, dst, tag).wait()

    def post_recv(self, array: np.ndarray, src: Optional[int], tag: int) -> RecvHandle:
        self._check_usable()
        self._numpy(array)
        self._check_tag(tag)
        request = self.comm.Irecv(self._buf(array), self.MPI.ANY_SOURCE if src is None else src, tag)
        return _Request(self, request, "recv", array, src, tag)

    # -- teardown --------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Free the communicators, unless an operation still runs in them (then they are left:
        freeing them under a running call is undefined)."""
        if self._closed:
            return
        self._closed = True
        WATCHDOG.group_gone(self.label)
        if WATCHDOG.in_flight(self):
            return
        for comm in (self.control, self.comm):
            if comm is not None:
                try:
                    comm.Free()
                except self.MPI.Exception:
                    pass
        self.control = self.comm = None
