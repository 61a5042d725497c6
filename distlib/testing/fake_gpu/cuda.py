"""A fake GPU: the part of cupy and of cupy's NCCL bindings that the nccl backend calls, run by
a thread, so that time, failure and teardown can be tested without a device, and a user's
``backend="nccl"`` job runs on CPU with correct numbers (distlib.testing: ``fake_gpus=N``).
Installed through ``distlib.backends.cupy_env.install``; nothing else changes.

What it models, and why (each is something the real-GPU runs of issue 25 tripped over):

* **A device that runs later.** Work on any stream goes into one in-order queue per process,
  run by a thread (a valid CUDA schedule: every wait is enqueued after what it waits for). An
  event is done once the queue has passed it; ``Device.synchronize`` waits for the queue.
* **Collectives that finish only when every rank has enqueued them.** Each rank's device thread
  posts its contribution to a directory shared by the ranks (``dir``; one file per operation
  and rank) and waits for the others': a silent rank holds everyone's collective, as on a GPU.
  A world of one needs no files.
* **Operations held back.** ``delays={seq: seconds}``: collective #seq of a communicator runs
  that much later (a slow kernel), so a teardown that does not wait for it is seen to lose it;
  ``hold()`` stops the device until released (operations pile up in flight).
* **Abort discards what is pending.** ``abort()`` ends the running operation and every queued
  one of that communicator without writing their outputs (their events still complete, as an
  aborted kernel's do) and tells the peers, whose ``check_async_error`` then raises.
  ``destroy()`` is ncclCommDestroy: it waits for the communicator's work to finish first.
* **Unsafe use is caught.** NCCL calls on one communicator must not overlap (NCCL's thread-
  safety rules), ``abort`` must not run while another thread is inside a call (cupy reads the
  communicator's pointer, ncclCommAbort frees it: a use after free, a SIGSEGV on the GPU), and
  nothing may be called after an abort or destroy. ``check_async_error`` may overlap an enqueue
  (its purpose). A violation is recorded (``violations``, and ``dir``/violations.txt for the
  other processes) and, with ``on_violation="crash"``, kills the process with SIGSEGV after
  printing every thread's stack, as the GPU did.
"""

from __future__ import annotations

import faulthandler
import itertools
import os
import queue
import signal
import sys
import threading
import time
import types
import weakref
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

violations: List[str] = []
_config: Dict[str, object] = {"dir": None, "delays": {}, "enqueue_s": 0.0, "on_violation": "record"}
_POLL_S = 0.001


def install(directory: Optional[str] = None, delays: Optional[Dict[int, float]] = None, enqueue_s: float = 0.0,
            on_violation: str = "record", devices: int = 1):
    """Make this process's nccl backend use the fake (before init_process_group)."""
    from distlib.backends import cupy_env

    _config.update(dir=directory, delays=dict(delays or {}), enqueue_s=enqueue_s, on_violation=on_violation)
    violations.clear()
    cupy_env.install(cupy, nccl, devices)
    return sys.modules[__name__]


def _violation(text: str) -> None:
    text = f"pid {os.getpid()}, thread {threading.current_thread().name}: {text}"
    violations.append(text)
    if _config["dir"]:
        with open(os.path.join(str(_config["dir"]), "violations.txt"), "a") as f:
            f.write(text + "\n")
    if _config["on_violation"] == "crash":
        sys.stderr.write(f"fake NCCL: {text}\n")
        faulthandler.dump_traceback(all_threads=True)
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGSEGV)


# -- the device: one in-order queue and its thread ---------------------------------------------


class _Device:
    def __init__(self) -> None:
        self.queue: "queue.SimpleQueue" = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name="fake-gpu", daemon=True)
        self.thread.start()

    def put(self, task: Callable[[], None]) -> None:
        self.queue.put(task)

    def _run(self) -> None:
        while True:
            task = self.queue.get()
            try:
                task()
            except Exception as exc:  # noqa: BLE001 - a fault of the fake itself, made loud
                _violation(f"the fake device failed running a task: {type(exc).__name__}: {exc}")

    def synchronize(self, timeout: float = 120.0) -> None:
        done = threading.Event()
        self.put(done.set)
        if not done.wait(timeout):
            raise RuntimeError(f"fake device: synchronize waited {timeout}s (is the device held?)")


_device = _Device()


def hold() -> threading.Event:
    """Stop the device until the returned event is set (everything enqueued meanwhile waits)."""
    release = threading.Event()
    _device.put(lambda: None if release.wait(300) else None)
    return release


class Event:
    """A CUDA event: done once the device has passed its last record (never recorded: done)."""

    queries = 0

    def __init__(self, block: bool = False, disable_timing: bool = True, interprocess: bool = False):
        self._done = True
        self.asked = 0

    @property
    def done(self) -> bool:
        Event.queries += 1
        self.asked += 1
        return self._done

    def _mark(self) -> None:
        self._done = True

    def synchronize(self) -> None:
        while not self._done:
            time.sleep(_POLL_S)


_stream_ids = itertools.count(1)
_current = threading.local()


class Stream:
    null: "Stream"  # the default stream (set below)
    def __init__(self, null: bool = False, non_blocking: bool = False, ptr: Optional[int] = None):
        self.ptr = 0 if null else next(_stream_ids)

    def record(self, event: Optional[Event] = None) -> Event:
        event = event or Event()
        event._done = False
        _device.put(event._mark)
        return event

    def wait_event(self, event: Event) -> None:
        """Nothing to do: the one queue runs this stream's later work after the record."""

    def synchronize(self) -> None:
        _device.synchronize()

    def __enter__(self) -> "Stream":
        stack = getattr(_current, "stack", None)
        if stack is None:
            stack = _current.stack = []
        stack.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _current.stack.pop()


Stream.null = Stream(null=True)


def get_current_stream() -> Stream:
    stack = getattr(_current, "stack", None)
    return stack[-1] if stack else Stream.null


class Device:
    def __init__(self, device: int = 0):
        self.id = int(device)

    def __enter__(self) -> "Device":
        return self

    def __exit__(self, *exc) -> None:
        pass

    def use(self) -> None:
        pass

    def synchronize(self) -> None:
        _device.synchronize()


# -- memory: arrays the device can find by address ----------------------------------------------

_allocations: Dict[int, Tuple["weakref.ref[np.ndarray]", int]] = {}


def _register(base: np.ndarray) -> None:
    _allocations[base.ctypes.data] = (weakref.ref(base), base.nbytes)


def _memory(ptr: int, nbytes: int) -> Optional[np.ndarray]:
    """The bytes at ``ptr``, or None (a violation) if no live allocation holds them."""
    for start, (ref, size) in list(_allocations.items()):
        if start <= ptr and ptr + nbytes <= start + size:
            base = ref()
            if base is None:
                break
            return base.reshape(-1).view(np.uint8)[ptr - start:ptr - start + nbytes]
    _violation(f"the device touched {nbytes} bytes at {ptr:#x}, which no live array holds (freed before the "
               f"operation ran: the backend did not keep it alive)")
    return None


class _Flags:
    def __init__(self, array: np.ndarray):
        self.c_contiguous = array.flags.c_contiguous


class _MemPtr:
    def __init__(self, ptr: int):
        self.ptr = ptr


class ndarray:  # noqa: N801 - cupy's name, which distlib.arrays recognises
    """A device array: numpy memory that only the device thread writes behind the host's back."""

    def __init__(self, host: np.ndarray, device: int = 0):
        self._a = host
        self.device = Device(device)

    dtype = property(lambda self: self._a.dtype)
    shape = property(lambda self: self._a.shape)
    size = property(lambda self: self._a.size)
    ndim = property(lambda self: self._a.ndim)
    nbytes = property(lambda self: self._a.nbytes)
    strides = property(lambda self: self._a.strides)
    flags = property(lambda self: _Flags(self._a))
    data = property(lambda self: _MemPtr(self._a.ctypes.data))

    def reshape(self, *shape) -> "ndarray":
        return ndarray(self._a.reshape(*shape), self.device.id)

    def view(self, dtype) -> "ndarray":
        return ndarray(self._a.view(dtype), self.device.id)

    def __getitem__(self, key) -> "ndarray":
        return ndarray(self._a[key], self.device.id)

    def __len__(self) -> int:
        return len(self._a)

    def _on_device(self, fn: Callable[[np.ndarray], None]) -> None:
        target = self._a
        _device.put(lambda: fn(target))

    def __imul__(self, factor):
        self._on_device(lambda a: np.multiply(a, factor, out=a, casting="unsafe"))
        return self

    def __itruediv__(self, by):
        self._on_device(lambda a: np.divide(a, by, out=a, casting="unsafe"))
        return self

    def fill(self, value) -> None:
        self._on_device(lambda a: a.fill(value))

    def set(self, host: np.ndarray, stream: Optional[Stream] = None) -> None:
        data = np.array(host, dtype=self.dtype, copy=True).reshape(self.shape)
        self._on_device(lambda a: np.copyto(a, data))

    def get(self, stream: Optional[Stream] = None, out: Optional[np.ndarray] = None) -> np.ndarray:
        _device.synchronize()
        if out is not None:
            np.copyto(out, self._a)
            return out
        return self._a.copy()

    def __repr__(self) -> str:
        return f"fake cupy array({self._a!r})"


ndarray.__module__ = "cupy"


def _new(host: np.ndarray) -> ndarray:
    host = np.ascontiguousarray(host)
    base = host if host.base is None else host.copy()
    _register(base)
    return ndarray(base)


def empty(shape, dtype=np.float32) -> ndarray:
    return _new(np.empty(shape, dtype=dtype))


def zeros(shape, dtype=np.float32) -> ndarray:
    return _new(np.zeros(shape, dtype=dtype))


def ones(shape, dtype=np.float32) -> ndarray:
    return _new(np.ones(shape, dtype=dtype))


def asarray(host, dtype=None) -> ndarray:
    return _new(np.array(host, dtype=dtype, copy=True))


def memcpyAsync(dst: int, src: int, nbytes: int, kind: int, stream: int) -> None:  # noqa: N802 - CUDA's name
    def copy() -> None:
        source, target = _memory(src, nbytes), _memory(dst, nbytes)
        if source is not None and target is not None:
            target[...] = source
    _device.put(copy)


runtime = types.SimpleNamespace(getDevice=lambda: 0, getDeviceCount=lambda: 1, memcpyAsync=memcpyAsync,
                                memcpyDeviceToDevice=3)
cuda = types.SimpleNamespace(Device=Device, Event=Event, Stream=Stream, get_current_stream=get_current_stream,
                             runtime=runtime)
cupy = types.SimpleNamespace(__name__="cupy", __version__="14.2.0+fake", cuda=cuda, ndarray=ndarray, empty=empty,
                             zeros=zeros, ones=ones, asarray=asarray)
from . import nccl  # noqa: E402 - the communicator needs the device above

nccl.bind(sys.modules[__name__])
