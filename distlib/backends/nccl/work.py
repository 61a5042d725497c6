"""The nccl backend's Work: an operation enqueued on the backend's stream, settled by the
watchdog (in issue order, in batches) once its event has completed, or failed with the
group's error.

It is made for every collective, so it is kept light: no lock and no threading.Event of its
own (the Future torch's ``get_future()`` returns is made only when asked for), a state that
the watchdog sets, and host waits that ask the event directly, with a deadline.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any, List, Optional, Protocol

import numpy as np

from ...deadline import Deadline, format_duration
from ...errors import DistBackendError
from ...work import Future
from ..base import RecvHandle
from .lifecycle import Lifecycle

PENDING, DONE, FAILED = 0, 1, 2
#: A host wait polls the event: at once a few times, then sleeping up to this long.
MAX_POLL_SLEEP_S = 0.001

_futures = threading.Lock()


class Stream(Protocol):
    """What a Work needs of its backend besides the group's state: its label, how long a host
    wait lasts by default, and ordering the caller's stream after an event."""

    label: str

    def host_wait_s(self) -> float: ...

    def stream_waits_for(self, event: Any) -> None: ...


class NcclWork:
    """torch's Work for an NCCL operation (see the module docstring; distlib.work.Work is the
    Protocol it implements).

    ``wait()`` makes the caller's current stream wait (the host only for a barrier or with a
    timeout); ``synchronize()`` blocks the host; ``is_completed()`` asks the event (once the
    group failed: only the watchdog, since an aborted kernel completes its event too). The
    group's state is ``lifecycle`` (lifecycle.py); the watchdog settles it (``settle``).
    """

    __slots__ = ("op_name", "seq", "_result", "_lifecycle", "_stream", "_event", "_blocking", "_state", "_error",
                 "_future_made")

    def __init__(self, lifecycle: Lifecycle, stream: Stream, op_name: str, seq: int, event, result: List[Any],
                 blocking: bool):
        # Light: no lock and no Event of its own (the Future is made only if asked for).
        self.op_name, self._result, self.seq = op_name, result, seq
        self._lifecycle, self._stream, self._event, self._blocking = lifecycle, stream, event, blocking
        self._state = PENDING
        self._error: Optional[BaseException] = None
        self._future_made: Optional[Future] = None

    # -- settling (the watchdog's thread) ---------------------------------------------------------

    def settle(self, error: Optional[BaseException]) -> None:
        """The operation has run (None) or the group failed (its error): once, by the watchdog,
        or by the backend for what was pending when it closed."""
        self._error = error
        self._state = FAILED if error is not None else DONE  # before the Future is looked at
        future = self._future_made
        if future is not None:
            future.settle(None if error is not None else self._result, error)

    def get_future(self) -> Future:
        """torch's Future, made on first use and settled by whichever of the watchdog and this
        thread sees the other's write last (Future.settle keeps the first)."""
        future = self._future_made
        if future is None:
            with _futures:
                future = self._future_made
                if future is None:
                    future = self._future_made = Future()
            if self._state != PENDING:
                future.settle(None if self._error is not None else self._result, self._error)
        return future

    # -- questions ------------------------------------------------------------------------------

    def is_completed(self) -> bool:
        if self._state != PENDING:
            return True
        return not self._lifecycle.failing.is_set() and bool(self._event.done)

    def is_success(self) -> bool:
        if self._state != PENDING:
            return self._state == DONE
        return not self._lifecycle.failing.is_set() and bool(self._event.done)

    def exception(self) -> Optional[BaseException]:
        return self._error

    def _raise_failure(self) -> None:
        error = self._error
        if error is not None:  # settled as failed
            raise error
        if self._state == PENDING:
            self._lifecycle.raise_if_failed()

    # -- waiting --------------------------------------------------------------------------------

    def _host_wait(self, seconds: Optional[float]) -> None:
        """Until the operation has run on the device, the group fails, or the time is up
        (default: the group timeout and the watchdog's diagnosis, with room)."""
        if seconds is None:
            seconds = self._stream.host_wait_s()
        deadline = Deadline(seconds)
        lifecycle, event, pause = self._lifecycle, self._event, 0.0
        while self._state == PENDING:
            lifecycle.raise_if_failed()
            if event.done:
                return
            if deadline.expired():
                raise DistBackendError(f"Work.wait timed out after {format_duration(seconds)}: {self.op_name} "
                                       f"(#{self.seq} of {self._stream.label}) has not finished")
            time.sleep(pause)
            pause = min(MAX_POLL_SLEEP_S, pause * 2 or 0.00005)

    def wait(self, timeout: Optional[timedelta] = None) -> bool:
        """The caller's current stream waits for the operation; with ``timeout`` (or for a
        barrier) the host blocks until it has finished, as torch's blocking wait."""
        if self._state == DONE:
            return True  # it has run: nothing left for the stream to wait for
        if timeout is not None or self._blocking:
            self._host_wait(None if timeout is None else
                            (timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)))
        self._raise_failure()
        if self._state == PENDING:
            self._stream.stream_waits_for(self._event)
        return True

    def synchronize(self) -> None:
        """Block the host until the operation has finished on the device."""
        self._host_wait(None)
        self._raise_failure()

    def result(self) -> List[Any]:
        self.wait()
        return self._result

    def __repr__(self) -> str:
        return f"NcclWork({self.op_name} #{self.seq}, {('pending', 'done', 'failed')[self._state]})"


class NcclRecv(RecvHandle):
    """irecv's handle on the nccl backend: the receive's Work and its peer."""

    def __init__(self, work: NcclWork, peer: int):
        self.work, self.peer = work, peer

    def wait(self) -> int:
        self.work.wait()
        return self.peer

    def is_completed(self) -> bool:
        return self.work.is_completed()


class DeviceArrays:
    """Object collectives on a GPU-only group: byte arrays on the group's device (torch's way)."""

    def __init__(self, backend):
        self.backend = backend
        self.cupy = backend.cupy
        self.device = backend.default_device()

    def put(self, host: np.ndarray):
        with self.cupy.cuda.Device(self.device):
            return self.cupy.asarray(host)

    def get(self, array) -> np.ndarray:
        with self.cupy.cuda.Device(self.device):
            host = array.get()
        self.backend.lifecycle.raise_if_failed()
        return host
