"""What the harness learns during a run, in the order it learned it.

Every source appends here: the rank agents (hello, collective, exception), the master service's
observer (store operations), the nodes' output (one event per line), the substrate (exits) and
the schedule (faults). Cues are matched against this log by one thread (the schedule's), and a
rank held at a cue is released once that thread has seen its event, so a fault due at a point
is in place before the rank goes past it.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional


@dataclass(frozen=True)
class Event:
    """One thing that happened: ``kind`` is hello, collective, exception, store, output, exit,
    fault or note; ``node`` the host it happened on; ``t`` the wall clock (every substrate shares
    the host's clock); ``rank`` the process's RANK (-1: not a rank, e.g. a launcher)."""

    kind: str
    node: str
    t: float
    rank: int = -1
    pid: int = 0
    data: Dict[str, Any] = field(default_factory=dict)

    def describe(self) -> str:
        who = f"rank {self.rank} on {self.node}" if self.rank >= 0 else self.node
        if self.kind == "collective":
            return f"{who} entered collective #{self.data['n']} ({self.data['op']})"
        if self.kind == "store":
            return f"{who}: store {self.data['op']} {self.data.get('key', '')!r}"
        if self.kind == "output":
            return f"{who} printed {self.data['line'][:120]!r}"
        return f"{who}: {self.kind} {self.data}"


class EventLog:
    """Append-only, thread-safe; readers wait for new events or for the schedule to catch up."""

    def __init__(self) -> None:
        self._events: List[Event] = []
        self._cond = threading.Condition()
        self._seen = 0  # events the schedule has looked at
        self.closed = False

    def append(self, event: Event) -> int:
        with self._cond:
            self._events.append(event)
            self._cond.notify_all()
            return len(self._events) - 1

    def add(self, kind: str, node: str, rank: int = -1, pid: int = 0, t: Optional[float] = None,
            **data: Any) -> int:
        return self.append(Event(kind, node, time.time() if t is None else t, rank, pid, data))

    def __len__(self) -> int:
        with self._cond:
            return len(self._events)

    def events(self, start: int = 0) -> List[Event]:
        with self._cond:
            return self._events[start:]

    def select(self, kind: Optional[str] = None, where: Optional[Callable[[Event], bool]] = None) -> List[Event]:
        return [e for e in self.events() if (kind is None or e.kind == kind) and (where is None or where(e))]

    def wait_new(self, start: int, timeout: float) -> List[Event]:
        """Events from index ``start`` on, waiting up to ``timeout`` s for one if there are none."""
        with self._cond:
            if len(self._events) <= start and not self.closed:
                self._cond.wait(timeout)
            return self._events[start:]

    def mark_seen(self, upto: int) -> None:
        """The schedule has looked at every event before index ``upto``."""
        with self._cond:
            self._seen = max(self._seen, upto)
            self._cond.notify_all()

    def wait_seen(self, index: int, timeout: float) -> bool:
        """Wait until the schedule has looked at event ``index`` (True), or ``timeout`` (False)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._seen <= index and not self.closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def close(self) -> None:
        """No schedule looks any more: waiters are released."""
        with self._cond:
            self.closed = True
            self._cond.notify_all()
