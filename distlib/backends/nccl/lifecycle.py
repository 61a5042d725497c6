"""``Lifecycle``: the one state of an nccl group, its error and the event that says so.

The backend, its watchdog, its communicator and its Works each need to know whether the group
still works, and to raise the same error when it does not; they all read this object, and
only it holds that state. Two dimensions, both one-way:

* **failure**: live, then *failing* (``failing``: a failure was seen; nothing new is enqueued),
  then *failed* (``error`` is made and ``ready`` is set; every later call raises it). The
  failure is an enqueue that NCCL or CUDA refused (``enqueue_failed``: the watchdog turns it
  into the group's error), the watchdog's (a timeout, an NCCL error), an init that failed, or
  an abort. The first error stays: an abort after a failure raises the failure.
  ``halted``: from the watchdog's failure or an abort on, an operation's completed event no
  longer means success (an aborted kernel completes its event too).
* **closing**: open, then destroyed (``destroy_process_group``: what is enqueued still
  finishes) or aborted; either refuses new operations, once.

Why one object: the four objects of the backend used to keep a part each (three events and
flags on the backend, three on the watchdog, which called the backend's private methods to
change them), so each question had to be asked of the right one.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Optional

from ...errors import DistBackendError
from ..base import refused_after_failure


@dataclass(frozen=True)
class EnqueueFailure:
    """An operation that NCCL or CUDA refused part-way through enqueueing: what it was, its
    number, whether it was a collective, and why."""

    what: str
    seq: int
    collective: bool
    cause: str


class Lifecycle:
    """One group's state (see the module docstring); ``label``: "pg0/nccl", for the texts;
    ``error_wait_s``: how long a caller waits for the error of a failure to be made (the
    watchdog's diagnosis reads the store)."""

    def __init__(self, label: str, error_wait_s: float):
        self.label, self.error_wait_s = label, error_wait_s
        #: Set from the first failure on: nothing new is enqueued (read with ``failing.is_set()``).
        self.failing = threading.Event()
        #: Set once ``error`` is made.
        self.ready = threading.Event()
        self.error: Optional[BaseException] = None
        #: From the watchdog's failure or an abort on, a completed event means nothing.
        self.halted = False
        #: None while open; "destroyed" or "aborted".
        self.closed: Optional[str] = None
        #: The enqueue that failed, until the watchdog has made the group's error of it.
        self.enqueue_failure: Optional[EnqueueFailure] = None
        self._lock = threading.Lock()

    # -- the failure -----------------------------------------------------------------------------

    def enqueue_failed(self, failure: EnqueueFailure) -> None:
        """Part of an operation may be enqueued and the peers wait for the rest: the group
        fails now (the watchdog aborts the communicator and makes the error)."""
        self.enqueue_failure = failure
        self.failing.set()

    def begin_failure(self) -> None:
        """A failure was seen: nothing new is enqueued from now on."""
        self.failing.set()

    def halt(self) -> None:
        """Completions mean nothing from now on (the communicator is about to be aborted)."""
        self.halted = True

    def fail(self, error: BaseException) -> BaseException:
        """The group's error, once: returns the one in force (the first)."""
        with self._lock:
            if self.error is None:
                self.error = error
            self.failing.set()
            self.ready.set()
            return self.error

    @property
    def failed(self) -> bool:
        """Whether the group's error is made."""
        return self.error is not None

    def refusal(self, rank: int) -> DistBackendError:
        """The error of a new operation on a group that is failing: it names the group's error
        (waiting up to ``error_wait_s`` for it to be made). The group stays failed until it is
        destroyed."""
        self.ready.wait(self.error_wait_s)
        return refused_after_failure(self.label, rank, self.error or DistBackendError(
            f"{self.label}: the NCCL communicator failed"))

    def raise_if_failed(self) -> None:
        """Raise the group's error if it is failing (waiting up to ``error_wait_s`` for it to
        be made)."""
        if self.failing.is_set():
            self.ready.wait(self.error_wait_s)
            raise self.error or DistBackendError(f"{self.label}: the NCCL communicator failed")

    # -- closing ---------------------------------------------------------------------------------

    def close(self, how: str) -> bool:
        """Refuse new operations from now on (``how``: "destroyed" or "aborted"); False if
        already closed."""
        with self._lock:
            if self.closed is not None:
                return False
            self.closed = how
            return True

    def check_open(self) -> None:
        """Raise if the group was destroyed or aborted."""
        if self.closed is not None:
            raise DistBackendError(f"{self.label}: the process group was {self.closed}")
