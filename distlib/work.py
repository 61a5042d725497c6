"""``Work`` (what an async collective returns), its ``Future``, and the per-group executor.

``Work`` is a Protocol (torch's Work's methods) with two implementations: ``HostWork`` here,
an operation that runs on the host in the group's order (settled by the executor, or by the
wait of an irecv), and the nccl backend's ``NcclWork`` (backends/nccl/work.py), an operation
enqueued on a device stream and settled by the backend's watchdog.

Operations on one group run in the order they were issued, sync and async alike. A sync call
on an idle group runs inline in the caller's thread, with no Work, no queue and no lock wait
(a thread hand-off costs ~100 µs on these VMs, more than a small collective through shared
memory); otherwise it queues behind the pending async operations and waits. The executor's
thread is a daemon: it never keeps a process alive.
"""

from __future__ import annotations

import collections
import threading
from datetime import timedelta
from typing import Any, Callable, Deque, List, Optional, Protocol, runtime_checkable

from .deadline import format_duration
from .errors import DistBackendError


class Future:
    """torch.futures.Future's common subset: wait, value, done, then, add_done_callback."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._value: Any = None
        self._error: Optional[BaseException] = None
        self._callbacks: List[Callable[["Future"], None]] = []
        self._lock = threading.Lock()

    def set_result(self, value: Any) -> None:
        self.settle(value, None)

    def set_exception(self, error: BaseException) -> None:
        self.settle(None, error)

    def settle(self, value: Any, error: Optional[BaseException]) -> None:
        """The producer's side: the value, or the error when one is given. The first call wins
        and later ones are ignored, so two threads that may each see the result last (the nccl
        watchdog and a caller of get_future) can both settle it."""
        with self._lock:
            if self._event.is_set():
                return
            self._value, self._error = value, error
            self._event.set()
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback(self)

    def done(self) -> bool:
        return self._event.is_set()

    def wait(self) -> Any:
        self._event.wait()
        if self._error is not None:
            raise self._error
        return self._value

    def value(self) -> Any:
        if not self._event.is_set():
            raise RuntimeError("Future.value() called before the future completed; call wait() first")
        if self._error is not None:
            raise self._error
        return self._value

    def add_done_callback(self, callback: Callable[["Future"], None]) -> None:
        with self._lock:
            if not self._event.is_set():
                self._callbacks.append(callback)
                return
        callback(self)

    def then(self, callback: Callable[["Future"], Any]) -> "Future":
        """A new future holding ``callback(self)``'s result (or its exception)."""
        chained = Future()

        def run(fut: "Future") -> None:
            try:
                chained.set_result(callback(fut))
            except BaseException as exc:  # noqa: BLE001 - handed to the chained future
                chained.set_exception(exc)

        self.add_done_callback(run)
        return chained


@runtime_checkable
class Work(Protocol):
    """The handle of an async operation (torch.distributed.Work): what every implementation
    offers, and what callers may use."""

    op_name: str

    def wait(self, timeout: Optional[timedelta] = None) -> bool:
        """Until the operation finished (host) or is ordered before the caller's stream
        (device); raise its error if it failed."""

    def synchronize(self) -> None:
        """Block the host until the operation finished; raise its error if it failed."""

    def is_completed(self) -> bool: ...

    def is_success(self) -> bool: ...

    def exception(self) -> Optional[BaseException]: ...

    def result(self) -> List[Any]: ...

    def get_future(self) -> Future: ...


class HostWork:
    """A Work settled on the host (``finish``): by the group's executor when the operation has
    run, or by the waiting of an irecv."""

    def __init__(self, op_name: str, result: Optional[List[Any]] = None):
        self.op_name = op_name
        self._result = result if result is not None else []
        self._future = Future()

    def finish(self, error: Optional[BaseException] = None, result: Optional[List[Any]] = None) -> None:
        """The operation is over: with ``error``, or its ``result`` (or the one given at first)."""
        if result is not None:
            self._result = result
        if error is None:
            self._future.set_result(self._result)
        else:
            self._future.set_exception(error)

    def is_completed(self) -> bool:
        return self._future.done()

    def is_success(self) -> bool:
        return self._future.done() and self._future._error is None

    def exception(self) -> Optional[BaseException]:
        return self._future._error

    def wait(self, timeout: Optional[timedelta] = None) -> bool:
        """Block until the operation finished; raise its error if it failed.

        With ``timeout``, raise DistBackendError if it has not finished by then (the operation
        itself keeps its own deadline, the group timeout).
        """
        seconds = None if timeout is None else (
            timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout))
        if not self._future._event.wait(seconds) and seconds is not None:  # without one it returns True
            raise DistBackendError(
                f"Work.wait timed out after {format_duration(seconds)}: {self.op_name} has not finished")
        if self._future._error is not None:
            raise self._future._error
        return True

    def synchronize(self) -> None:
        """The same as wait(): a host operation has no stream to order."""
        self.wait()

    def result(self) -> List[Any]:
        self.wait()
        return self._result

    def get_future(self) -> Future:
        return self._future

    def __repr__(self) -> str:
        state = "done" if self.is_completed() else "pending"
        return f"Work({self.op_name}, {state})"


class OrderedExecutor:
    """Runs a group's operations one at a time, in issue order.

    ``_turn`` is held by whoever runs an operation (the caller of a sync one, or the
    executor's thread); ``_queued`` counts async operations submitted and not yet finished.
    A sync call that takes the turn and finds nothing queued runs at once; an async
    operation submitted earlier keeps ``_queued`` above zero until it has run, so a sync
    call can never overtake it.
    """

    def __init__(self, name: str):
        self.name = name
        self._queue: Deque = collections.deque()
        self._cond = threading.Condition()
        self._turn = threading.Lock()
        self._queued = 0
        self._thread: Optional[threading.Thread] = None
        self._closed = False

    def submit(self, work: HostWork, fn: Callable[[], Optional[List[Any]]]) -> HostWork:
        """Queue ``fn`` (returns the result list, or None) to run after everything before it."""
        with self._cond:
            if self._closed:
                raise DistBackendError(f"{self.name}: the process group was destroyed")
            self._queue.append((work, fn))
            self._queued += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=f"distlib-exec-{self.name}", daemon=True)
                self._thread.start()
            self._cond.notify_all()
        return work

    def run(self, op_name: str, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` now, in this thread, if nothing is pending; else after the pending work."""
        turn = self._turn
        if not self._queued and turn.acquire(False):
            if not self._queued and not self._closed:
                try:
                    return fn(*args)
                finally:
                    turn.release()
            turn.release()
        if self._closed:
            raise DistBackendError(f"{self.name}: the process group was destroyed")
        box: List[Any] = []
        work = HostWork(op_name)
        self.submit(work, lambda: box.append(fn(*args)))
        work.wait()
        return box[0] if box else None

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._closed and not self._queue:
                    self._cond.wait()
                if self._closed and not self._queue:
                    return
                work, fn = self._queue.popleft()
            error: Optional[BaseException] = None
            result = None
            try:
                with self._turn:
                    result = fn()
            except BaseException as exc:  # noqa: BLE001 - the Work carries it to the caller
                error = exc
            with self._cond:
                self._queued -= 1  # before the Work completes: a sync call after wait() runs inline
            if error is None:
                work.finish(None, result if isinstance(result, list) else None)
            else:
                work.finish(error)

    def close(self, error: BaseException) -> None:
        """Fail everything queued with ``error`` and stop the thread."""
        with self._cond:
            self._closed = True
            pending = list(self._queue)
            self._queue.clear()
            self._queued -= len(pending)
            self._cond.notify_all()
        for work, _ in pending:
            work.finish(error)
