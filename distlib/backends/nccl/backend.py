"""The ``nccl`` backend: collectives on cupy arrays through cupy's NCCL bindings.

What it does the way torch's ProcessGroupNCCL does:

* **One communicator per group and rank**, on one GPU (devices.py says which). Rank 0
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
* **Work** (work.py): ``wait()`` makes the current stream wait, ``wait(timeout)`` and
  ``synchronize()`` block the host, ``is_completed()`` asks the event, ``exception()`` holds
  the failure. The watchdog settles Works in issue order, in batches; a call costs the same
  however many operations are in flight.
* **Failure:** a watchdog (watchdog.py) aborts the communicator on a timeout or an NCCL
  error, and every later call or ``wait()`` raises DistBackendError naming the operation, its
  number in the group and the ranks that had not reached it. The group's state (failing,
  failed and its error, destroyed or aborted) is one object, ``self.lifecycle``
  (lifecycle.py), which the watchdog, the communicator and the Works read. Every NCCL call on
  the communicator goes through comm.Communicator, one thread at a time.
* **Teardown, as torch >= 2.6:** ``shutdown()`` (destroy_process_group) waits for every
  enqueued operation (the watchdog still enforces the timeout), then destroys the
  communicator; it aborts only a group that has already failed. ``abort()`` (torch's
  ``Backend.abort()``, ``_abort_process_group``) drops what is pending at once.

What each collective is in NCCL calls is plan.py; how dtypes and ops map is
dtypes.py. This module only turns plans into cupy calls: keep it small.
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import timedelta
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ...deadline import Deadline
from ...errors import DistBackendError
from ...identity import Identity
from ...reduce_op import ReduceOp
from ...store.chain import close_quietly, innermost
from .. import cupy_env
from ..base import RecvHandle, StreamOrderedBackend
from ..join import local_facts, publish_and_gather
from . import plan as P
from .comm import Communicator
from .devices import check_same_device, choose_device, parse_device_id, shared_gpus_hint
from .dtypes import UINT8, Wire, reduction, unique_id_bytes, unique_id_for, wire
from .lifecycle import EnqueueFailure, Lifecycle
from .watchdog import SILENCE_CHECK_S, Diagnosis, Heartbeat, Pending, Watchdog
from .work import DeviceArrays, NcclRecv, NcclWork

log = logging.getLogger("distlib.backends.nccl")

_BYTES = Wire(UINT8, "uint8", 1)
#: Room beyond the group timeout for a destroy's flush: the watchdog fails the group at the
#: timeout and then diagnoses (SILENCE_CHECK_S); this is only the backstop.
FLUSH_ROOM_S = SILENCE_CHECK_S + 5.0
#: How many recorded-and-finished events are kept for reuse (an event costs a driver call).
EVENT_POOL = 1024


class NcclBackend(StreamOrderedBackend):
    name = "nccl"

    def __init__(self, store, rank: int, size: int, timeout: timedelta, label: str = "nccl", device_id=None,
                 identity: Identity = Identity()):
        super().__init__(store, rank, size, timeout)
        #: Who this process is (its node, its local rank), as its creator read it: no backend reads the environment
        self.identity = identity
        found = cupy_env.require()
        self.cupy, self.nccl, self.device_count = found.cupy, found.nccl, found.devices
        self._runtime = self.cupy.cuda.runtime
        self.label = label
        self.timeout_s = timeout.total_seconds()
        self.bound = parse_device_id(device_id, self.device_count)
        self.version = int(self.nccl.get_version())
        self.device: Optional[int] = None
        self.comm: Optional[Communicator] = None
        self.stream: Any = None  # cupy's Stream and Event, made with the communicator
        self._ready: Any = None
        self._events: List[Any] = []
        self._plans: Dict[Tuple, Tuple[P.Plan, Any]] = {}
        self.seq = 0
        self.p2p_seq = 0
        self.hosts: Dict[int, str] = {}
        self.watchdog: Optional[Watchdog] = None
        self.heartbeat: Optional[Heartbeat] = None
        self._watch_store = None
        self._lock = threading.RLock()
        #: The group's state: failing, failed (its error), destroyed or aborted
        self.lifecycle = Lifecycle(label, SILENCE_CHECK_S + 30.0)
        if self.bound is not None:
            with self._lock:
                self._connect(self.bound, f"device_id={self.bound}")

    # -- the communicator ------------------------------------------------------------------------

    def _connect(self, device: int, why: str) -> None:
        """Join the group's ranks and make the communicator on ``device`` (collective)."""
        cupy, who = self.cupy, f"{self.label} rank {self.rank}"
        try:
            record = dict(local_facts(self.identity))
            record["device"] = device
            if self.rank == 0:
                with cupy.cuda.Device(device):
                    record["unique_id"] = unique_id_bytes(self.nccl.get_unique_id()).hex()
            records = publish_and_gather(self.store, self.rank, self.size, record, Deadline(self.timeout_s), who)
            self.hosts = {r: str(rec.get("hostname", "?")) for r, rec in enumerate(records)}
            unique_id = unique_id_for(bytes.fromhex(str(records[0]["unique_id"])),
                                      as_tuple=cupy_env.cupy_major(cupy) < 14)
            try:
                comm = Communicator.create(self.nccl, self.size, unique_id, self.rank,
                                           lambda: cupy.cuda.Device(device), self.timeout_s, f"{who} on cuda:{device}",
                                           self.lifecycle)
            except DistBackendError as exc:
                hosts = ", ".join(sorted(set(self.hosts.values())))
                raise DistBackendError(f"{exc} (all {self.size} ranks had joined, on {hosts}; run with NCCL_DEBUG=INFO "
                                       f"to see where NCCL stopped){shared_gpus_hint(records)}") from exc.__cause__
            with cupy.cuda.Device(device):
                self.stream = cupy.cuda.Stream(non_blocking=True)
                self._ready = cupy.cuda.Event(block=False, disable_timing=True)
        except BaseException as exc:
            if not isinstance(exc, (ValueError, TypeError)):
                self.lifecycle.fail(exc)  # the group cannot be used: every later call says why
            raise
        self.comm, self.device = comm, device
        log.info("%s: NCCL %d communicator of %d ranks on cuda:%d (%s)", who, self.version, self.size, device, why)
        self._watch_store = self._own_store()
        self.heartbeat = Heartbeat(self._watch_store, self.rank, lambda: self.seq, self.label).start()
        diagnosis = Diagnosis(who, self.size, self._watch_store, self.hosts, device, lambda: self.seq,
                              self.lifecycle)
        self.watchdog = Watchdog(self.label, self.timeout_s, self.lifecycle, comm, diagnosis,
                                 on_thread_start=lambda: cupy.cuda.Device(device).use(),
                                 recycle=self._recycle).start()

    def _own_store(self):
        """A second connection for the heartbeat and the diagnosis (see watchdog.Heartbeat),
        whose waits are short: a diagnosis must not wait a group timeout for a lost store."""
        try:
            store = self.store.clone()
        except Exception:  # noqa: BLE001 - a store that cannot be cloned is shared instead
            return self.store
        if innermost(store) is not innermost(self.store):  # a HashStore's clone is itself: shared
            try:
                store.set_timeout(timedelta(seconds=min(self.timeout_s, 2 * SILENCE_CHECK_S)))
            except Exception:  # noqa: BLE001 - a store without timeouts keeps its own
                pass
        return store

    def default_device(self) -> int:
        """The device of this rank's communicator, or the one it would get (no array given)."""
        if self.device is not None:
            return self.device
        return choose_device(None, self.bound, self.identity, self._runtime.getDevice(), self.device_count)[0]

    def _device_for(self, arrays: Sequence, requested: Optional[int] = None) -> int:
        """The communicator's device, made now if need be; ``requested``: barrier's device_ids[0]."""
        device = self.device  # set with the communicator
        if self.comm is not None and requested is None and device is not None:
            for a in arrays:
                if a.device.id != device:
                    check_same_device(int(a.device.id), device, "the array", self.label)
            return device
        devices = sorted({int(a.device.id) for a in arrays} | ({requested} if requested is not None else set()))
        if len(devices) > 1:
            raise ValueError(f"the arrays of one operation must be on one GPU, got "
                             f"{', '.join(f'cuda:{d}' for d in devices)}")
        array_device = devices[0] if devices else None
        if self.comm is None:
            device, why = choose_device(array_device, self.bound, self.identity, self._runtime.getDevice(),
                                        self.device_count)
            self._connect(device, why)
        elif array_device is not None and self.device is not None:  # the device is set with the communicator
            check_same_device(array_device, self.device, "the array", self.label)
        assert self.device is not None, "_connect sets the device"
        return self.device

    # -- failure ---------------------------------------------------------------------------------

    def failing(self) -> bool:
        return self.lifecycle.failing.is_set()

    def host_wait_s(self) -> float:
        """A host wait's default deadline: the group timeout, the diagnosis, and room."""
        return self.timeout_s + SILENCE_CHECK_S + 30.0

    def raise_if_failed(self) -> None:
        self.lifecycle.raise_if_failed()

    def _enqueue_failed(self, what: str, collective: bool, exc: BaseException) -> DistBackendError:
        """Part of an operation may be enqueued and the others wait for the rest: fail the group
        now; the watchdog aborts the communicator and makes the full error for later calls."""
        seq = (self.seq if collective else self.p2p_seq) + 1
        cause = f"could not be enqueued on rank {self.rank} ({type(exc).__name__}: {exc})"
        self.lifecycle.enqueue_failed(EnqueueFailure(what, seq, collective, cause))
        assert self.watchdog is not None, "started with the communicator, before any enqueue"
        self.watchdog.wake.set()
        return DistBackendError(f"{self.label} rank {self.rank}: {what} {cause}; the NCCL communicator is being "
                                f"aborted: destroy_process_group() and init again to go on")

    # -- enqueueing ------------------------------------------------------------------------------

    def _recycle(self, event) -> None:
        """A finished operation's event, for a later one (the watchdog's thread)."""
        if len(self._events) < EVENT_POOL:
            self._events.append(event)

    def stream_waits_for(self, event) -> None:
        """The caller's current stream (on the communicator's device) waits for ``event``."""
        cuda = self.cupy.cuda
        if self._runtime.getDevice() == self.device:
            cuda.get_current_stream().wait_event(event)
            return
        with cuda.Device(self.device):
            cuda.get_current_stream().wait_event(event)

    def _launch(self, op_name: str, plan: P.Plan, arrays: List[Any], collective: bool = True,
                blocking: bool = False, result: Optional[List[Any]] = None, device: Optional[int] = None,
                view=None) -> NcclWork:
        with self._lock:
            lifecycle = self.lifecycle
            if lifecycle.closed is not None:
                lifecycle.check_open()
            if lifecycle.failing.is_set():  # the group stays failed: a new operation names the failure
                raise lifecycle.refusal(self.rank)
            device = self._device_for(arrays, device)
            if view is None:
                view = self._view_dtype(plan.wire, arrays)
            if self._runtime.getDevice() == device:
                return self._enqueue(op_name, plan, view, arrays, collective, blocking, result)
            with self.cupy.cuda.Device(device):
                return self._enqueue(op_name, plan, view, arrays, collective, blocking, result)

    def _enqueue(self, op_name: str, plan: P.Plan, view, arrays: List[Any], collective: bool, blocking: bool,
                 result: Optional[List[Any]]) -> NcclWork:
        """The operation after the caller's stream, on the backend's stream, and its Work;
        ``view``: the dtype NCCL's counts are in (the plan's wire, as the array library has it)."""
        cupy, stream, comm, watchdog = self.cupy, self.stream, self.comm, self.watchdog
        assert comm is not None and watchdog is not None, "made by _device_for's _connect"
        stream.wait_event(cupy.cuda.get_current_stream().record(self._ready))  # ready: reusable at once
        temps = ()
        if plan.temps:
            with stream:
                temps = tuple(cupy.empty(n, dtype=view) for n in plan.temps)
        buffers = [*arrays, *temps]
        raw = comm.acquire()  # aborted by the watchdog meanwhile: the group's error
        try:
            self._issue(raw, plan.steps, buffers, view, plan.wire.nccl_type)
        except Exception as exc:  # NCCL or CUDA refused part of it: the group is broken
            raise self._enqueue_failed(_describe(op_name, arrays), collective, exc) from exc
        finally:
            comm.release()
        done = self._events.pop() if self._events else cupy.cuda.Event(block=False, disable_timing=True)
        stream.record(done)
        if collective:
            self.seq += 1
            seq = self.seq
        else:
            self.p2p_seq += 1
            seq = self.p2p_seq
        work = NcclWork(self.lifecycle, self, op_name, seq, done, arrays if result is None else result, blocking)
        watchdog.add(Pending(seq, collective, op_name, arrays[0] if arrays else None, time.monotonic(), done,
                                  buffers, work))
        return work

    def _view_dtype(self, how: Wire, arrays: Sequence):
        for a in arrays:
            if a.dtype.name == how.view:
                return a.dtype  # bfloat16 and the like: the array library's own dtype object
        return np.dtype(how.view)

    def _issue(self, comm, steps, buffers, view, nccl_type: int) -> None:
        """Each step as one cupy call on the backend's stream (see plan.py); NCCL gets
        pointers (no array views are made except for a local Scale or Divide)."""
        stream, itemsize = self.stream.ptr, view.itemsize
        bases = [b.data.ptr for b in buffers]

        def ptr(region: P.Region) -> int:
            return bases[region.buffer] + region.start * itemsize

        def part(region: P.Region):
            return buffers[region.buffer].reshape(-1).view(view)[region.start:region.start + region.count]

        for step in steps:
            kind = type(step)
            if kind is P.AllReduce:
                if step.src.count:
                    comm.allReduce(ptr(step.src), ptr(step.dst), step.src.count, nccl_type, step.op, stream)
            elif kind is P.Group:
                self._group(comm, step.steps, ptr, nccl_type, stream)
            elif kind is P.Reduce and step.src.count:
                comm.reduce(ptr(step.src), ptr(step.dst), step.src.count, nccl_type, step.op, step.root, stream)
            elif kind is P.Broadcast and step.src.count:
                comm.broadcast(ptr(step.src), ptr(step.dst), step.src.count, nccl_type, step.root, stream)
            elif kind is P.AllGather and step.src.count:
                comm.allGather(ptr(step.src), ptr(step.dst), step.src.count, nccl_type, stream)
            elif kind is P.ReduceScatter and step.dst.count:
                comm.reduceScatter(ptr(step.src), ptr(step.dst), step.dst.count, nccl_type, step.op, stream)
            elif kind is P.Copy and step.src.count:
                runtime = self._runtime
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

    def _group(self, comm, steps, ptr, nccl_type: int, stream: int) -> None:
        """Send/Recv steps between ncclGroupStart and ncclGroupEnd."""
        if not steps:
            return
        nccl = self.nccl
        nccl.groupStart()
        try:
            for step in steps:
                if type(step) is P.Send and step.src.count:
                    comm.send(ptr(step.src), step.src.count, nccl_type, step.peer, stream)
                elif type(step) is P.Recv and step.dst.count:
                    comm.recv(ptr(step.dst), step.dst.count, nccl_type, step.peer, stream)
        except BaseException:
            try:
                nccl.groupEnd()
            except Exception:  # noqa: BLE001 - the first error is the one to report
                pass
            raise
        nccl.groupEnd()

    # -- collectives -----------------------------------------------------------------------------

    def _cached(self, key: Tuple, build, arrays: Sequence) -> Tuple[P.Plan, Any]:
        """(plan, view dtype) for ``key`` (a plan is never changed once built): the small
        collectives of a training step repeat, and building one costs as much as enqueueing it."""
        found = self._plans.get(key)
        if found is None:
            plan = build()
            found = (plan, self._view_dtype(plan.wire, arrays))
            if len(self._plans) < 4096:
                self._plans[key] = found
        return found

    def broadcast(self, array, root: int) -> NcclWork:
        plan, view = self._cached(("broadcast", array.dtype, array.size, root),
                                  lambda: P.broadcast(wire(array.dtype), array.size, root), (array,))
        return self._launch("broadcast", plan, [array], view=view)

    def all_reduce(self, array, op: ReduceOp) -> NcclWork:
        plan, view = self._cached(("all_reduce", array.dtype, array.size, op.op, op.factor),
                                  lambda: P.all_reduce(reduction(array.dtype, op, self.version), array.size,
                                                       self.size), (array,))
        return self._launch("all_reduce", plan, [array], view=view)

    def reduce(self, array, root: int, op: ReduceOp) -> NcclWork:
        plan = P.reduce(reduction(array.dtype, op, self.version), array.size, root, self.rank, self.size)
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
        plan = P.reduce_scatter(reduction(output.dtype, op, self.version), output.size, self.size)
        return self._launch("reduce_scatter", plan, [output, *inputs], result=[output])

    def reduce_scatter_into(self, output, array, op: ReduceOp) -> NcclWork:
        plan = P.reduce_scatter_into(reduction(output.dtype, op, self.version), output.size, self.size)
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
        return NcclRecv(work, src)

    def batch_p2p(self, items: Sequence[Tuple[bool, Any, int]]) -> NcclWork:
        """(is_send, array, group peer) per operation, in one NCCL group; arrays travel as bytes,
        so one batch may mix dtypes (each still has to be one NCCL has)."""
        for _, array, _ in items:
            wire(array.dtype)
        plan = P.batch_p2p(_BYTES, [(is_send, array.nbytes, peer) for is_send, array, peer in items])
        return self._launch("batch_isend_irecv", plan, [array for _, array, _ in items], collective=False)

    # -- objects, teardown -----------------------------------------------------------------------

    def object_arrays(self) -> DeviceArrays:
        return DeviceArrays(self)

    def shutdown(self) -> None:
        """destroy_process_group, as torch >= 2.6: every enqueued operation finishes first
        (within the group timeout, which the watchdog still enforces: a dead peer fails the
        group, and then it is aborted), then ncclCommDestroy; the threads stop."""
        with self._lock:
            if not self.lifecycle.close("destroyed"):
                return
        if self.watchdog is not None and not self.watchdog.handled_failure:
            if not self.watchdog.flush(self.timeout_s + FLUSH_ROOM_S):
                self.watchdog.fail_all(f"was still pending when destroy_process_group() had waited "
                                       f"{self.timeout_s + FLUSH_ROOM_S:.1f}s for it")
        self._stop_threads(DistBackendError(f"{self.label}: the process group was destroyed before this "
                                            f"operation finished"))
        if self.comm is not None:
            if self.lifecycle.failing.is_set():
                self.comm.abort()  # done already by the failure; idempotent
            else:
                self.comm.destroy()
        self._release()

    def abort(self, reason: Optional[str] = None) -> None:
        """torch's Backend.abort(): ncclCommAbort now; what is pending is dropped and its Work
        fails with ``reason``; later calls raise the same."""
        with self._lock:
            if not self.lifecycle.close("aborted"):
                return
        pending = self.watchdog.outstanding() if self.watchdog is not None else 0
        error = DistBackendError(f"{self.label} rank {self.rank}: the process group was aborted"
                                 f"{f' ({reason})' if reason else ''}; {pending} operation(s) still pending were "
                                 f"dropped")
        self.lifecycle.fail(error)  # the first error stays (a failure before the abort)
        if self.watchdog is not None:
            self.watchdog.halt()
        if self.comm is not None:
            self.comm.abort()
        self._stop_threads(error)
        self._release()

    def _stop_threads(self, error: BaseException) -> None:
        left: List[Pending] = self.watchdog.close() if self.watchdog is not None else []
        for pending in left:
            pending.work.settle(error)
        if self.heartbeat is not None:
            self.heartbeat.close()

    def _release(self) -> None:
        if self._watch_store is not None and innermost(self._watch_store) is not innermost(self.store):
            close_quietly(self._watch_store)
        self._watch_store = None
        self._events.clear()


def _describe(op_name: str, arrays: Sequence) -> str:
    if not arrays:
        return op_name
    first = arrays[0]
    return f"{op_name} of {first.size} x {first.dtype}"
