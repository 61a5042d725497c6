"""The nccl backend's watchdog: outstanding work against the timeout, NCCL's asynchronous
errors, and the error that names who had not reached the operation.

NCCL work runs on the GPU after the call that enqueued it has returned, so nothing on the
host notices by itself that it never finishes. A thread per backend polls (``Watchdog``):
the oldest outstanding operation's completion (they finish in issue order: one stream) and
its age against the group timeout, and the communicator's asynchronous error
(``ncclCommGetAsyncError``: a peer that exited, a network failure); it settles finished Works
in batches. On the first failure it aborts the communicator (so the stuck kernels end), has
the failure described (``Diagnosis``) and makes it the group's error in the group's
``Lifecycle`` (lifecycle.py), which every later call, and every ``wait()``, raises. It reads
the state it needs there too (an enqueue that failed, whether completions still count) and
calls nothing private of the backend. A destroy waits for the queue to empty (``flush``)
while the watchdog keeps enforcing the timeout.

To say who is to blame, which torch cannot, every rank publishes a small record in the
group's store (``Heartbeat``): the sequence number of the last collective it issued and a
heart-beat counter, every HEARTBEAT_S. The error reads the records twice, SILENCE_CHECK
apart: ranks whose last issued collective is before the failed one had not reached it, and
ranks whose counter did not move are dead or frozen.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Deque, Dict, List, Optional, Protocol, Sequence, Tuple

from ...deadline import format_duration
from ...errors import DistBackendError
from .lifecycle import Lifecycle

log = logging.getLogger("distlib.backends.nccl")

#: Seconds between a rank's record updates: often enough that a silent rank is told apart
#: from a slow one within a few seconds, rarely enough that 1000 ranks cost the store little.
HEARTBEAT_S = 2.0
#: How long the diagnosis watches the counters: longer than one heartbeat with room to spare.
SILENCE_CHECK_S = 1.5 * HEARTBEAT_S
#: Poll intervals: short while work is outstanding (a finished Work's future is settled this
#: late at most), long when idle (only the asynchronous error is checked).
BUSY_POLL_S = 0.002
IDLE_POLL_S = 0.1
#: How long closing waits for the watchdog's and the heart-beat's threads.
THREAD_JOIN_S = 5.0


def record_key(rank: int) -> str:
    return f"nccl_seq/{rank}"


@dataclass(frozen=True)
class Record:
    """What a rank publishes: the last collective it issued (0: none yet) and its heart-beat."""

    issued: int
    beat: int

    def encode(self) -> bytes:
        return f"{self.issued} {self.beat}".encode()

    @classmethod
    def decode(cls, raw: bytes) -> "Record":
        issued, beat = raw.decode().split()
        return cls(int(issued), int(beat))


def read_records(store, size: int) -> Tuple[Dict[int, Record], str]:
    """Every rank's record that exists, and "" or what went wrong reading the store."""
    records: Dict[int, Record] = {}
    try:
        for rank in range(size):
            if store.check([record_key(rank)]):
                records[rank] = Record.decode(store.get(record_key(rank)))
    except Exception as exc:  # noqa: BLE001 - the store may be gone with a dead rank 0
        return records, f"{type(exc).__name__}: {exc}"
    return records, ""


def laggards(seq: int, size: int, *readings: Dict[int, Record]) -> List[int]:
    """Ranks that, in every reading, had not issued collective ``seq`` (or had no record)."""
    def reached(rank: int) -> bool:
        return any(rank in r and r[rank].issued >= seq for r in readings)

    return [rank for rank in range(size) if not reached(rank)]


def silent(size: int, first: Dict[int, Record], second: Dict[int, Record]) -> List[int]:
    """Ranks whose heart-beat did not move between the readings (or that have no record)."""
    return [rank for rank in range(size)
            if rank not in second or (rank in first and first[rank].beat == second[rank].beat)]


def _ranks(ranks: Sequence[int], hosts: Dict[int, str], records: Dict[int, Record], limit: int = 16) -> str:
    parts = []
    for rank in ranks[:limit]:
        where = f" on {hosts[rank]}" if rank in hosts else ""
        last = f", last issued #{records[rank].issued}" if rank in records else ", no record"
        parts.append(f"rank {rank}{where}{last}")
    if len(ranks) > limit:
        parts.append(f"and {len(ranks) - limit} more")
    return "; ".join(parts)


def failure_text(label: str, what: str, seq: Optional[int], collective: bool, cause: str, size: int,
                 first: Dict[int, Record], second: Dict[int, Record], hosts: Dict[int, str],
                 watched_s: float, store_problem: str = "") -> str:
    """The error every later call raises: the operation and its number (None: no operation was
    outstanding), the cause, the ranks that had not reached it and the ranks that went silent."""
    latest = {**first, **second}
    number = "" if seq is None else f" ({'collective' if collective else 'point-to-point'} #{seq} in this group)"
    parts = [f"{label}: {what}{number} {cause}."]
    if store_problem:
        parts.append(f"Could not read the ranks' records from the store ({store_problem}), so who had not "
                     f"reached it is unknown; if rank 0 hosted the store, rank 0 is gone.")
    else:
        if collective and seq is not None:
            behind = laggards(seq, size, first, second)
            parts.append(f"Ranks that had not reached #{seq}: {_ranks(behind, hosts, latest) if behind else 'none'}.")
        quiet = silent(size, first, second)
        if quiet:
            parts.append(f"No heart-beat for {format_duration(watched_s)} from: {_ranks(quiet, hosts, latest)} "
                         f"(dead or frozen).")
    parts.append("The NCCL communicator was aborted: destroy_process_group() and init again to go on.")
    return " ".join(parts)


def diagnose(store, size: int, stop: threading.Event, watch_s: float = SILENCE_CHECK_S):
    """Read the records, watch the heart-beats for ``watch_s`` (sooner if ``stop``), read again."""
    first, problem = read_records(store, size)
    started = time.monotonic()
    if not problem:
        stop.wait(watch_s)
        second, problem = read_records(store, size)
    else:
        second = {}
    return first, second, problem, time.monotonic() - started


class Heartbeat:
    """Publishes this rank's Record every HEARTBEAT_S on a store of its own (a clone, so that
    a long wait on the shared connection never delays it)."""

    def __init__(self, store, rank: int, issued: Callable[[], int], label: str):
        self.store, self.rank, self.issued, self.label = store, rank, issued, label
        self.stop = threading.Event()
        self.beat = 0
        self._warned = False
        self.thread = threading.Thread(target=self._loop, name=f"distlib-nccl-heartbeat-{label}", daemon=True)

    def start(self) -> "Heartbeat":
        self.publish()
        self.thread.start()
        return self

    def publish(self) -> None:
        self.beat += 1
        try:
            self.store.set(record_key(self.rank), Record(self.issued(), self.beat).encode())
        except Exception as exc:  # noqa: BLE001 - a lost store must not kill the thread
            if not self._warned:
                self._warned = True
                log.warning("%s: rank %d cannot publish its sequence record (%s); a failure's error will "
                            "not know who lagged", self.label, self.rank, exc)

    def _loop(self) -> None:
        while not self.stop.wait(HEARTBEAT_S):
            self.publish()

    def close(self) -> None:
        self.stop.set()
        if self.thread.is_alive() and self.thread is not threading.current_thread():
            self.thread.join(timeout=THREAD_JOIN_S)


class Diagnosis:
    """The text of a group's failure: which operation (the oldest outstanding, the enqueue
    that failed, or none: an idle communicator), its number, the cause, and who had not
    reached it or went silent (the ranks' records in ``store``, read twice)."""

    def __init__(self, label: str, size: int, store, hosts: Dict[int, str], device: int,
                 issued: Callable[[], int], lifecycle: Lifecycle):
        self.label, self.size, self.store, self.hosts, self.device = label, size, store, hosts, device
        self.issued, self.lifecycle = issued, lifecycle

    def describe(self, oldest: Optional["Pending"], cause: str, stop: threading.Event) -> str:
        first, second, problem, watched = diagnose(self.store, self.size, stop)
        refused = self.lifecycle.enqueue_failure
        if refused is not None:
            what, seq, collective = f"{refused.what} on cuda:{self.device}", refused.seq, refused.collective
        elif oldest is None:
            what, seq, collective = (f"the communicator on cuda:{self.device}, idle after collective "
                                     f"#{self.issued()},", None, True)
        else:
            what, seq, collective = f"{oldest.what} on cuda:{self.device}", oldest.seq, oldest.collective
        return failure_text(self.label, what, seq, collective, cause, self.size, first, second, self.hosts,
                            watched, problem)


class Settles(Protocol):
    """What the watchdog needs of an operation's Work: to be settled, once, with None
    (success) or the group's error."""

    def settle(self, error: Optional[BaseException]) -> None: ...


class Watched(Protocol):
    """What the watchdog needs of the communicator: its asynchronous error, and its abort."""

    def async_error(self) -> Optional[str]: ...

    def abort(self) -> None: ...


class Describes(Protocol):
    """What makes a failure's text (``Diagnosis``)."""

    def describe(self, oldest: Optional["Pending"], cause: str, stop: threading.Event) -> str: ...


class Pending:
    """One enqueued operation: its number, what it is (made into text only for an error), when
    it was enqueued, the event recorded after it, what must stay alive until it has run, and
    its Work (``work.settle(error_or_None)``)."""

    __slots__ = ("seq", "collective", "op_name", "first", "started", "event", "keep", "work")

    def __init__(self, seq: int, collective: bool, op_name: str, first, started: float, event, keep,
                 work: Settles):
        self.seq, self.collective, self.op_name, self.first = seq, collective, op_name, first
        self.started, self.event, self.keep, self.work = started, event, keep, work

    @property
    def what(self) -> str:
        """"all_reduce of 4 x float32", or the bare name for an operation without arrays."""
        if self.first is None:
            return self.op_name
        return f"{self.op_name} of {self.first.size} x {self.first.dtype}"


class Watchdog:
    """Settles the outstanding operations in issue order and fails them all on the first
    timeout or asynchronous error.

    Operations of one backend run on one stream, so they finish in issue order: each round
    asks only the oldest operation's event, and settles in one batch every finished one from
    the front of the queue. Work per operation is constant however many are in flight (issue
    25: a list searched by value made a call cost grow with the queue). ``add`` wakes the
    thread only when the queue was empty: no hand-off per operation.

    On a failure (``fail_all``, once) it marks the group failing and halted in ``lifecycle``,
    aborts ``comm``, has ``diagnosis`` describe the failure, makes that the group's error,
    settles every outstanding operation with it, and stops. An exception of the watchdog
    itself (an event query raising: the device is gone) is such a failure, so the group fails
    with its text instead of hanging on a dead thread. ``recycle(event)`` gets each finished
    operation's event for reuse.
    """

    def __init__(self, label: str, timeout_s: float, lifecycle: Lifecycle, comm: Watched, diagnosis: Describes,
                 on_thread_start: Optional[Callable[[], None]] = None,
                 recycle: Optional[Callable[[Any], None]] = None):
        self.label, self.timeout_s = label, timeout_s
        self.lifecycle, self.comm, self.diagnosis = lifecycle, comm, diagnosis
        self.on_thread_start, self.recycle = on_thread_start, recycle
        self.pending: Deque[Pending] = collections.deque()
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)
        self.wake = threading.Event()
        self.stop = threading.Event()
        self._handled = False  # fail_all has run (once)
        self._once = threading.Lock()
        self.thread = threading.Thread(target=self._loop, name=f"distlib-nccl-watchdog-{label}", daemon=True)

    def start(self) -> "Watchdog":
        self.thread.start()
        return self

    def add(self, pending: Pending) -> None:
        with self.lock:
            was_empty = not self.pending
            self.pending.append(pending)
        if was_empty:
            self.wake.set()

    def outstanding(self) -> int:
        return len(self.pending)

    def _loop(self) -> None:
        try:
            if self.on_thread_start is not None:
                self.on_thread_start()
            while not self.stop.is_set():
                if self.poll_once():
                    return
                self.wake.wait(BUSY_POLL_S if self.pending else IDLE_POLL_S)
                self.wake.clear()
        except Exception as exc:  # noqa: BLE001 - the watchdog's own failure fails the group, loudly
            log.error("%s: the NCCL watchdog failed: %s: %s", self.label, type(exc).__name__, exc)
            self.fail_all(f"could not be watched: the watchdog failed ({type(exc).__name__}: {exc})")

    def poll_once(self, now: Optional[float] = None) -> bool:
        """One round: settle what finished; True once a failure was handled (the loop ends)."""
        finished = []
        with self.lock:
            pending = self.pending
            while pending and not self.lifecycle.halted and pending[0].event.done:
                finished.append(pending.popleft())
            oldest = pending[0] if pending else None
            if finished:
                self.changed.notify_all()
        for entry in finished:  # one batch, outside the lock
            entry.work.settle(None)
            if self.recycle is not None:
                self.recycle(entry.event)
        refused = self.lifecycle.enqueue_failure
        cause = refused.cause if refused is not None else self.comm.async_error()
        if cause is None and oldest is not None:
            age = (time.monotonic() if now is None else now) - oldest.started
            if age > self.timeout_s:
                cause = f"timed out after {format_duration(age)} (timeout {format_duration(self.timeout_s)})"
        if cause is None:
            return False
        self.fail_all(cause, oldest)
        return True

    def fail_all(self, cause: str, oldest: Optional[Pending] = None) -> BaseException:
        """Fail the group once (from the watchdog, or from a destroy that ran out of time):
        the communicator is aborted, the failure described and made the group's error (the
        first error stays: an abort's, if it came first), every outstanding operation settled
        with it."""
        lifecycle = self.lifecycle
        with self._once:
            if self._handled and lifecycle.error is not None:
                return lifecycle.error
            with self.lock:
                lifecycle.halt()  # an aborted kernel completes its event too: no more successes
                if oldest is None and self.pending:
                    oldest = self.pending[0]
            lifecycle.begin_failure()  # from here on, nothing new is enqueued
            self.comm.abort()
            text = self.diagnosis.describe(oldest, cause, self.stop)
            log.error("%s", text)
            error = lifecycle.fail(DistBackendError(text))
            with self.lock:
                failed, self.pending = self.pending, collections.deque()
                self._handled = True
                self.changed.notify_all()
            for entry in failed:
                entry.work.settle(error)
            return error

    @property
    def handled_failure(self) -> bool:
        """Whether the watchdog failed the group (fail_all ran)."""
        return self._handled

    def halt(self) -> None:
        """Settle nothing as a success from now on (the communicator is about to be aborted)."""
        with self.lock:
            self.lifecycle.halt()

    def flush(self, seconds: float) -> bool:
        """Wait until every outstanding operation is settled, or the watchdog failed the group,
        within ``seconds``; True if so (the watchdog keeps running meanwhile and enforces the
        timeout)."""
        with self.lock:
            return self.changed.wait_for(lambda: not self.pending or self._handled, seconds)

    def close(self) -> List[Pending]:
        """Stop the thread (bounded); returns what was still outstanding."""
        self.stop.set()
        self.wake.set()
        if self.thread.is_alive() and self.thread is not threading.current_thread():
            self.thread.join(timeout=THREAD_JOIN_S)
        with self.lock:
            left, self.pending = list(self.pending), collections.deque()
        return left
