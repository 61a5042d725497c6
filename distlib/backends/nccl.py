"""The ``nccl`` backend: collectives on cupy arrays through cupy's NCCL bindings.

What it does the way torch's ProcessGroupNCCL does:

* **One communicator per group and rank**, on one GPU (nccl_devices.py says which). Rank 0
  makes the unique id and publishes it with its join record through the group's store; every
  rank waits for everyone's record (backends/join.py: the timeout names the missing ranks),
  then ``ncclCommInitRank`` runs with a deadline. At init when ``device_id`` is given, else at
  the group's first collective. A subgroup gets a communicator of its own, with its own id
  (``commSplit`` would need every rank of the parent, and distlib's non-members of a
  ``new_group`` take no part in it).
* **Streams:** each operation is enqueued on the backend's own stream after that stream waits
  for the caller's current stream; the call returns once it is enqueued, and a synchronous
  call leaves the caller's stream waiting on the operation (no host synchronisation). Arrays
  and temporaries are kept alive until the operation has finished on the GPU.
* **Work:** ``wait()`` makes the current stream wait, ``wait(timeout)`` and ``synchronize()``
  block the host, ``is_completed()`` asks the event, ``exception()`` holds the failure.
* **Failure:** a watchdog (nccl_watchdog.py) aborts the communicator on a timeout or an NCCL
  error, and every later call or ``wait()`` raises DistBackendError naming the operation, its
  number in the group and the ranks that had not reached it.

What each collective is in NCCL calls is nccl_plan.py; how dtypes and ops map is
nccl_types.py. This module only turns plans into cupy calls: keep it small.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from datetime import timedelta
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..deadline import Deadline, format_duration
from ..errors import DistBackendError
from ..reduce_op import ReduceOp
from ..work import Work
from . import cupy_env
from . import nccl_plan as P
from .base import RecvHandle, StreamOrderedBackend
from .join import local_facts, publish_and_gather
from .nccl_devices import check_same_device, choose_device, parse_device_id, shared_gpus_hint
from .nccl_types import UINT8, Wire, reduction, unique_id_bytes, unique_id_for, wire
from .nccl_watchdog import SILENCE_CHECK_S, Heartbeat, Pending, Watchdog, diagnose, failure_text

log = logging.getLogger("distlib.backends.nccl")

_BYTES = Wire(UINT8, "uint8", 1)


def _describe(op_name: str, arrays: Sequence) -> str:
    if not arrays:
        return op_name
    first = arrays[0]
    return f"{op_name} of {first.size} x {first.dtype}"


class NcclWork(Work):
    """An enqueued NCCL operation; settled by the watchdog when its event has completed."""

    def __init__(self, backend: "NcclBackend", op_name: str, seq: int, event, result, blocking: bool):
        super().__init__(op_name, list(result))
        self._backend, self._event, self._blocking = backend, event, blocking
        self.seq = seq

    def _settle(self, error: Optional[BaseException]) -> None:
        self._finish(error)

    def is_completed(self) -> bool:
        """The event's answer; once the communicator failed, only the watchdog's (an aborted
        kernel also completes its event)."""
        if self._future.done():
            return True
        return not self._backend.failing() and bool(self._event.done)

    def exception(self) -> Optional[BaseException]:
        return self._future._error if self._future.done() else None

    def _raise_failure(self) -> None:
        if self._future.done():
            if self._future._error is not None:
                raise self._future._error
            return
        self._backend.raise_if_failed()

    def _host_wait(self, timeout: Optional[float]) -> None:
        """Until the watchdog settles this Work, the communicator fails, or the time is up
        (without ``timeout``: the group timeout and the watchdog's diagnosis, with room)."""
        seconds = timeout if timeout is not None else self._backend.timeout_s + SILENCE_CHECK_S + 30.0
        deadline = Deadline(seconds)
        while not self._future._event.wait(min(0.1, deadline.remaining())):
            if self._backend.failing():
                self._backend.raise_if_failed()
            if deadline.expired():
                raise DistBackendError(f"Work.wait timed out after {format_duration(seconds)}: {self.op_name} "
                                       f"has not finished")

    def wait(self, timeout: Optional[timedelta] = None) -> bool:
        """The current stream waits for the operation; with ``timeout`` (or for a barrier)
        the host blocks until it has finished, as torch's blocking wait."""
        if timeout is not None or self._blocking:
            self._host_wait(None if timeout is None else
                            (timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)))
        self._raise_failure()
        self._backend.stream_waits_for(self._event)
        return True

    def synchronize(self) -> None:
        """Block the host until the operation has finished on the GPU."""
        self._host_wait(None)
        self._raise_failure()


class _NcclRecv(RecvHandle):
    def __init__(self, work: NcclWork, peer: int):
        self.work, self.peer = work, peer

    def wait(self) -> int:
        self.work.wait()
        return self.peer

    def is_completed(self) -> bool:
        return self.work.is_completed()


class _DeviceArrays:
    """Object collectives on a GPU-only group: byte arrays on the group's device (torch's way)."""

    def __init__(self, backend: "NcclBackend"):
        self.backend = backend
        self.cupy = backend.cupy
        self.device = backend.default_device()

    def put(self, host: np.ndarray):
        with self.cupy.cuda.Device(self.device):
            return self.cupy.asarray(host)

    def get(self, array) -> np.ndarray:
        with self.cupy.cuda.Device(self.device):
            host = array.get()
        self.backend.raise_if_failed()
        return host


class NcclBackend(StreamOrderedBackend):
    name = "nccl"

    def __init__(self, store, rank: int, size: int, timeout: timedelta, label: str = "nccl", device_id=None):
        super().__init__(store, rank, size, timeout)
        found = cupy_env.require()
        self.cupy, self.nccl, self.device_count = found.cupy, found.nccl, found.devices
        self.label = label
        self.timeout_s = timeout.total_seconds()
        self.bound = parse_device_id(device_id, self.device_count)
        self.version = int(self.nccl.get_version())
        self.device: Optional[int] = None
        self.comm = None
        self.stream = None
        self.seq = 0
        self.p2p_seq = 0
        self.hosts: Dict[int, str] = {}
        self.watchdog: Optional[Watchdog] = None
        self.heartbeat: Optional[Heartbeat] = None
        self._watch_store = None
        self._lock = threading.RLock()
        self._failing = threading.Event()
        self._failure_ready = threading.Event()
        self._failure: Optional[BaseException] = None
        self._enqueue_failure: Optional[Tuple[str, int, bool, str]] = None
        self._closed = False
        if self.bound is not None:
            with self._lock:
                self._connect(self.bound, f"device_id={self.bound}")

    # -- the communicator ------------------------------------------------------------------------

    def _connect(self, device: int, why: str) -> None:
        """Join the group's ranks and make the communicator on ``device`` (collective)."""
        cupy, who = self.cupy, f"{self.label} rank {self.rank}"
        try:
            record = dict(local_facts())
            record["device"] = device
            if self.rank == 0:
                with cupy.cuda.Device(device):
                    record["unique_id"] = unique_id_bytes(self.nccl.get_unique_id()).hex()
            records = publish_and_gather(self.store, self.rank, self.size, record, Deadline(self.timeout_s), who)
            self.hosts = {r: str(rec.get("hostname", "?")) for r, rec in enumerate(records)}
            unique_id = unique_id_for(bytes.fromhex(str(records[0]["unique_id"])),
                                      as_tuple=cupy_env.cupy_major(cupy) < 14)
            comm = self._init_communicator(unique_id, device, records)
            with cupy.cuda.Device(device):
                self.stream = cupy.cuda.Stream(non_blocking=True)
        except BaseException as exc:
            if not isinstance(exc, (ValueError, TypeError)):
                self._failure = exc  # the group cannot be used: every later call says why
                self._failing.set()
                self._failure_ready.set()
            raise
        self.comm, self.device = comm, device
        log.info("%s: NCCL %d communicator of %d ranks on cuda:%d (%s)", who, self.version, self.size, device, why)
        self._watch_store = self._own_store()
        self.heartbeat = Heartbeat(self._watch_store, self.rank, lambda: self.seq, self.label).start()
        self.watchdog = Watchdog(self.label, self.timeout_s, self._async_error, self._fail,
                                 on_thread_start=lambda: cupy.cuda.Device(device).use()).start()

    def _init_communicator(self, unique_id, device: int, records):
        """ncclCommInitRank in a helper thread, so that it has a deadline like every other wait."""
        box: Dict[str, object] = {}

        def run() -> None:
            try:
                with self.cupy.cuda.Device(device):
                    box["comm"] = self.nccl.NcclCommunicator(self.size, unique_id, self.rank)
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
                box["error"] = exc

        thread = threading.Thread(target=run, name=f"distlib-nccl-init-{self.label}", daemon=True)
        thread.start()
        thread.join(self.timeout_s)
        where = f"{self.label} rank {self.rank}: ncclCommInitRank on cuda:{device}"
        if thread.is_alive():
            raise DistBackendError(
                f"{where} did not finish within {format_duration(self.timeout_s)}, although all {self.size} ranks "
                f"had joined (on {', '.join(sorted(set(self.hosts.values())))}); run with NCCL_DEBUG=INFO to see "
                f"where NCCL stopped{shared_gpus_hint(records)}")
        if "error" in box:
            raise DistBackendError(f"{where} failed: {box['error']}{shared_gpus_hint(records)}") from box["error"]
        return box["comm"]

    def _own_store(self):
        """A second connection for the heartbeat and the diagnosis (see nccl_watchdog.Heartbeat)."""
        try:
            return self.store.clone()
        except Exception:  # noqa: BLE001 - a store that cannot be cloned is shared instead
            return self.store

    def default_device(self) -> int:
        """The device of this rank's communicator, or the one it would get (no array given)."""
        if self.device is not None:
            return self.device
        return choose_device(None, self.bound, os.environ, self.cupy.cuda.runtime.getDevice(),
                             self.device_count)[0]

    def _device_for(self, arrays: Sequence, requested: Optional[int] = None) -> int:
        """The communicator's device, made now if need be; ``requested``: barrier's device_ids[0]."""
        devices = sorted({int(a.device.id) for a in arrays} | ({requested} if requested is not None else set()))
        if len(devices) > 1:
            raise ValueError(f"the arrays of one operation must be on one GPU, got "
                             f"{', '.join(f'cuda:{d}' for d in devices)}")
        array_device = devices[0] if devices else None
        if self.comm is None:
            device, why = choose_device(array_device, self.bound, os.environ, self.cupy.cuda.runtime.getDevice(),
                                        self.device_count)
            self._connect(device, why)
        elif array_device is not None:
            check_same_device(array_device, self.device, "the array", self.label)
        return self.device

    # -- failure ---------------------------------------------------------------------------------

    def failing(self) -> bool:
        return self._failing.is_set()

    def raise_if_failed(self) -> None:
        if self._failing.is_set():
            self._failure_ready.wait(SILENCE_CHECK_S + 30.0)
            raise self._failure or DistBackendError(f"{self.label}: the NCCL communicator failed")

    def _enqueue_failed(self, what: str, collective: bool, exc: BaseException) -> DistBackendError:
        """Part of an operation may be enqueued and the others wait for the rest: fail the group
        now; the watchdog aborts the communicator and makes the full error for later calls."""
        seq = (self.seq if collective else self.p2p_seq) + 1
        cause = f"could not be enqueued on rank {self.rank} ({type(exc).__name__}: {exc})"
        self._enqueue_failure = (what, seq, collective, cause)
        self._failing.set()
        self.watchdog.wake.set()
        return DistBackendError(f"{self.label} rank {self.rank}: {what} {cause}; the NCCL communicator is being "
                                f"aborted: destroy_process_group() and init again to go on")

    def _async_error(self) -> Optional[str]:
        if self._enqueue_failure is not None:
            return self._enqueue_failure[3]
        try:
            self.comm.check_async_error()
        except self.nccl.NcclError as exc:
            return f"failed: NCCL reported {exc}"
        return None

    def _fail(self, pending: Optional[Pending], cause: str) -> BaseException:
        """The watchdog's failure: abort, find who lagged, keep the error for every later call."""
        self._failing.set()
        try:
            self.comm.abort()
        except Exception as exc:  # noqa: BLE001 - the error below matters more
            log.warning("%s: aborting the NCCL communicator failed: %s", self.label, exc)
        first, second, problem, watched = diagnose(self._watch_store, self.size, self.watchdog.stop)
        if self._enqueue_failure is not None:
            what, seq, collective, _ = self._enqueue_failure
            what = f"{what} on cuda:{self.device}"
        elif pending is None:
            what, seq, collective = (f"the communicator on cuda:{self.device}, idle after collective #{self.seq},",
                                     None, True)
        else:
            what, seq, collective = f"{pending.what} on cuda:{self.device}", pending.seq, pending.collective
        text = failure_text(f"{self.label} rank {self.rank}", what, seq, collective, cause, self.size, first, second,
                            self.hosts, watched, problem)
        log.error("%s", text)
        self._failure = DistBackendError(text)
        self._failure_ready.set()
        return self._failure

    # -- enqueueing ------------------------------------------------------------------------------

    def stream_waits_for(self, event) -> None:
        """The caller's current stream (on the communicator's device) waits for ``event``."""
        with self.cupy.cuda.Device(self.device):
            self.cupy.cuda.get_current_stream().wait_event(event)

    def _launch(self, op_name: str, plan: P.Plan, arrays: Sequence, collective: bool = True,
                blocking: bool = False, result: Optional[Sequence] = None, device: Optional[int] = None) -> NcclWork:
        cupy = self.cupy
        with self._lock:
            if self._closed:
                raise DistBackendError(f"{self.label}: the process group was destroyed")
            self.raise_if_failed()
            device = self._device_for(arrays, device)
            with cupy.cuda.Device(device):
                ready = cupy.cuda.Event(block=False, disable_timing=True)
                cupy.cuda.get_current_stream().record(ready)
                self.stream.wait_event(ready)
                view = self._view_dtype(plan.wire, arrays)
                with self.stream:
                    temps = [cupy.empty(n, dtype=view) for n in plan.temps]
                views = [a.reshape(-1).view(view) for a in arrays] + temps
                try:
                    self._issue(plan.steps, views, view.itemsize, plan.wire.nccl_type)
                except Exception as exc:  # NCCL or CUDA refused part of it: the group is broken
                    raise self._enqueue_failed(_describe(op_name, arrays), collective, exc) from exc
                done = cupy.cuda.Event(block=False, disable_timing=True)
                self.stream.record(done)
            if collective:
                self.seq += 1
                seq = self.seq
            else:
                self.p2p_seq += 1
                seq = self.p2p_seq
            work = NcclWork(self, op_name, seq, done, arrays if result is None else result, blocking)
            self.watchdog.add(Pending(seq, collective, _describe(op_name, arrays), time.monotonic(),
                                      lambda: done.done, (arrays, views, ready), work._settle))
            return work

    def _view_dtype(self, how: Wire, arrays: Sequence):
        for a in arrays:
            if a.dtype.name == how.view:
                return a.dtype  # bfloat16 and the like: the array library's own dtype object
        return np.dtype(how.view)

    def _issue(self, steps, views, itemsize: int, nccl_type: int) -> None:
        """Each step as one cupy call on the backend's stream (see nccl_plan.py)."""
        comm, stream = self.comm, self.stream.ptr
        runtime = self.cupy.cuda.runtime

        def ptr(region: P.Region) -> int:
            return views[region.buffer].data.ptr + region.start * itemsize

        def part(region: P.Region):
            return views[region.buffer][region.start:region.start + region.count]

        for step in steps:
            kind = type(step)
            if kind is P.Group:
                self._group(step.steps, views, itemsize, nccl_type)
            elif kind is P.AllReduce and step.src.count:
                comm.allReduce(ptr(step.src), ptr(step.dst), step.src.count, nccl_type, step.op, stream)
            elif kind is P.Reduce and step.src.count:
                comm.reduce(ptr(step.src), ptr(step.dst), step.src.count, nccl_type, step.op, step.root, stream)
            elif kind is P.Broadcast and step.src.count:
                comm.broadcast(ptr(step.src), ptr(step.dst), step.src.count, nccl_type, step.root, stream)
            elif kind is P.AllGather and step.src.count:
                comm.allGather(ptr(step.src), ptr(step.dst), step.src.count, nccl_type, stream)
            elif kind is P.ReduceScatter and step.dst.count:
                comm.reduceScatter(ptr(step.src), ptr(step.dst), step.dst.count, nccl_type, step.op, stream)
            elif kind is P.Send and step.src.count:
                comm.send(ptr(step.src), step.src.count, nccl_type, step.peer, stream)
            elif kind is P.Recv and step.dst.count:
                comm.recv(ptr(step.dst), step.dst.count, nccl_type, step.peer, stream)
            elif kind is P.Copy and step.src.count:
                runtime.memcpyAsync(ptr(step.dst), ptr(step.src), step.src.count * itemsize,
                                    runtime.memcpyDeviceToDevice, stream)
            elif kind is P.Scale and step.region.count:
                with self.stream:
                    target = part(step.region)
                    target *= step.factor
            elif kind is P.Divide and step.region.count:
                with self.stream:
                    target = part(step.region)
                    target /= step.by

    def _group(self, steps, views, itemsize: int, nccl_type: int) -> None:
        if not steps:
            return
        self.nccl.groupStart()
        try:
            self._issue(steps, views, itemsize, nccl_type)
        except BaseException:
            try:
                self.nccl.groupEnd()
            except Exception:  # noqa: BLE001 - the first error is the one to report
                pass
            raise
        self.nccl.groupEnd()

    # -- collectives -----------------------------------------------------------------------------

    def _reduction(self, array, op: ReduceOp):
        return reduction(array.dtype, op, self.version)

    def broadcast(self, array, root: int) -> NcclWork:
        return self._launch("broadcast", P.broadcast(wire(array.dtype), array.size, root), [array])

    def all_reduce(self, array, op: ReduceOp) -> NcclWork:
        return self._launch("all_reduce", P.all_reduce(self._reduction(array, op), array.size, self.size), [array])

    def reduce(self, array, root: int, op: ReduceOp) -> NcclWork:
        plan = P.reduce(self._reduction(array, op), array.size, root, self.rank, self.size)
        return self._launch("reduce", plan, [array])

    def all_gather(self, outputs, array) -> NcclWork:
        plan = P.all_gather(wire(array.dtype), array.size, self.size)
        return self._launch("all_gather", plan, [array, *outputs], result=list(outputs))

    def all_gather_into(self, output, array) -> NcclWork:
        plan = P.all_gather_into(wire(array.dtype), array.size, self.size)
        return self._launch("all_gather_into_tensor", plan, [output, array], result=[output])

    def gather(self, outputs, array, root: int) -> NcclWork:
        plan = P.gather(wire(array.dtype), array.size, root, self.rank, self.size)
        arrays = [array, *outputs] if self.rank == root else [array]
        return self._launch("gather", plan, arrays, result=list(outputs or []))

    def scatter(self, output, inputs, root: int) -> NcclWork:
        plan = P.scatter(wire(output.dtype), output.size, root, self.rank, self.size)
        arrays = [output, *inputs] if self.rank == root else [output]
        return self._launch("scatter", plan, arrays, result=[output])

    def reduce_scatter(self, output, inputs, op: ReduceOp) -> NcclWork:
        plan = P.reduce_scatter(self._reduction(output, op), output.size, self.size)
        return self._launch("reduce_scatter", plan, [output, *inputs], result=[output])

    def reduce_scatter_into(self, output, array, op: ReduceOp) -> NcclWork:
        plan = P.reduce_scatter_into(self._reduction(output, op), output.size, self.size)
        return self._launch("reduce_scatter_tensor", plan, [output, array], result=[output])

    def all_to_all(self, outputs, inputs) -> NcclWork:
        plan = P.all_to_all(wire(inputs[0].dtype), [o.size for o in outputs], [i.size for i in inputs], self.rank)
        return self._launch("all_to_all", plan, [*outputs, *inputs], result=list(outputs))

    def all_to_all_single(self, output, array, output_splits: List[int], input_splits: List[int]) -> NcclWork:
        out_row = int(np.prod(output.shape[1:])) if output.ndim > 1 else 1
        in_row = int(np.prod(array.shape[1:])) if array.ndim > 1 else 1
        plan = P.all_to_all_single(wire(array.dtype), output_splits, input_splits, out_row, in_row, self.rank)
        return self._launch("all_to_all_single", plan, [output, array], result=[output])

    def barrier(self, device_ids: Optional[Sequence[int]] = None) -> NcclWork:
        """An all_reduce of one byte; its Work's wait() blocks the host, as torch's does."""
        device = int(device_ids[0]) if device_ids else None
        return self._launch("barrier", P.barrier(_BYTES), [], blocking=True, result=[], device=device)

    # -- point to point --------------------------------------------------------------------------

    def send(self, array, dst: int, tag: int) -> NcclWork:
        return self._launch("send", P.send(wire(array.dtype), array.size, dst), [array], collective=False)

    def post_recv(self, array, src: Optional[int], tag: int) -> RecvHandle:
        if src is None:
            raise ValueError("the nccl backend cannot receive from any source (src=None): NCCL has no wildcard "
                             "receive; pass src")
        work = self._launch("recv", P.recv(wire(array.dtype), array.size, src), [array], collective=False)
        return _NcclRecv(work, src)

    def batch_p2p(self, items: Sequence[Tuple[bool, object, int]]) -> NcclWork:
        """(is_send, array, group peer) per operation, in one NCCL group; arrays travel as bytes,
        so one batch may mix dtypes (each still has to be one NCCL has)."""
        for _, array, _ in items:
            wire(array.dtype)
        plan = P.batch_p2p(_BYTES, [(is_send, array.nbytes, peer) for is_send, array, peer in items])
        return self._launch("batch_isend_irecv", plan, [array for _, array, _ in items], collective=False)

    # -- objects, teardown -----------------------------------------------------------------------

    def object_arrays(self) -> _DeviceArrays:
        return _DeviceArrays(self)

    def shutdown(self) -> None:
        """Stop the threads and abort the communicator (torch's destroy_process_group aborts too:
        a destroy that waited for a dead peer would hang)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        left: List[Pending] = self.watchdog.close() if self.watchdog is not None else []
        if self.heartbeat is not None:
            self.heartbeat.close()
        if self.comm is not None:
            try:
                self.comm.abort()
            except Exception as exc:  # noqa: BLE001 - teardown goes on
                log.warning("%s: aborting the NCCL communicator at destroy failed: %s", self.label, exc)
            self.comm = None
        gone = DistBackendError(f"{self.label}: the process group was destroyed before this operation finished")
        for pending in left:
            pending.settle(gone)
        if self._watch_store is not None and self._watch_store is not self.store:
            _close(self._watch_store)
        self._watch_store = None
        self.stream = None

    def abort(self, reason: str) -> None:
        self.shutdown()


def _close(store) -> None:
    """Close the innermost store of a clone (a TCP connection of its own)."""
    while hasattr(store, "underlying_store"):
        store = store.underlying_store
    close = getattr(store, "close", None)
    if callable(close):
        close()
