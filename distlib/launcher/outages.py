"""The rendezvous store's absences as one elastic agent sees them: when it stopped answering,
when it answered again, and whether the agent has waited too long.

Why a module of its own: an agent talks to the store through two clients (its loop's and its
heartbeat thread's, rounds_store.py), and an absence is the store's, not a client's: it begins
at the first call of either that failed and ends at the first call of either that got an
answer. ``StoreOutages`` is that one account, shared by both clients. It says one line when the
store goes away (the workers keep running) and one when it is back (for how long), so a person
reading the log sees the gap; the agent takes each ended absence (``take_ended``) to stop its
clocks for it (bookkeeping.py) and to record it in the job's state (rounds.note_outage).

How long an agent waits for the store is ``bound`` (``--store-outage-timeout``, 60 s by
default): a master service that restarts (a pod rescheduled, a process restarted by its
supervisor) and replays its journal is back well within it; one that is gone for good makes
every node fail naming it shortly after the bound (rounds_store.StoreGone).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable, List, Optional

from ..deadline import format_duration


@dataclass(frozen=True)
class Absence:
    """One absence of the store, ended: from ``started`` (wall clock, seconds since the epoch)
    for ``seconds`` (this agent's monotonic clock)."""

    started: float
    seconds: float


class StoreOutages:
    """The store's absences, from every client of one agent (module docstring). ``say`` prints a
    line for a person (the launcher's stderr)."""

    def __init__(self, where: str, bound: float, slow: float, say: Callable[[str], None]):
        self.where = where
        self.bound = bound
        #: a call that took longer than this (seconds) met a store that was away (frozen,
        #: overloaded, its host paused) even though it answered in the end
        self.slow = slow
        self._say = say
        self._lock = threading.Lock()
        #: (monotonic, wall clock) of the failed call that began the current absence
        self._down: Optional[tuple] = None
        self._ended: List[Absence] = []

    def failed(self, call_started: float, what: str, error: BaseException) -> float:
        """A call that began at ``call_started`` (monotonic) got no answer: the absence began then,
        unless it had begun before. Returns how long the store has been away."""
        now = time.monotonic()
        with self._lock:
            if self._down is None:
                self._down = (call_started, time.time() - (now - call_started))
                self._say(f"the rendezvous store ({self.where}) did not answer ({what}: {error}): the workers keep "
                          f"running; retrying for up to {format_duration(self.bound)} (--store-outage-timeout)")
            return now - self._down[0]

    def away(self) -> float:
        """How long the store has been away (0 when it answers)."""
        down = self._down
        return 0.0 if down is None else time.monotonic() - down[0]

    def answered(self, call_started: float, what: str) -> None:
        """A call that began at ``call_started`` got an answer: an absence, if there was one, is
        over; a call slower than ``slow`` was one (the store answered late, it did not fail)."""
        now = time.monotonic()
        if self._down is None and now - call_started <= self.slow:  # the common case, without the lock
            return
        with self._lock:
            if self._down is None:
                seconds = now - call_started
                if seconds <= self.slow:
                    return
                self._ended.append(Absence(time.time() - seconds, seconds))
                said = (f"the rendezvous store ({self.where}) took {format_duration(seconds)} to answer ({what}): "
                        "the job goes on where it was, no restart")
            else:
                seconds = now - self._down[0]
                self._ended.append(Absence(self._down[1], seconds))
                self._down = None
                said = (f"the rendezvous store ({self.where}) answers again after {format_duration(seconds)} away: "
                        "the job goes on where it was, no restart")
        self._say(said)

    def take_ended(self) -> List[Absence]:
        """The absences that ended since the last call (oldest first)."""
        with self._lock:
            ended, self._ended = self._ended, []
        return ended
