"""``Strangers``: the connections on their way in that have proven nothing yet, and their budget.

Why: a peer without the token can open connections and never answer the challenge. Held to
a fixed number per address and refused past it, 600 such connections locked a token holder
on the same address out for as long as they lived (issue 37: "512 connections from 127.0.0.1
are already on their way in"); behind NAT, or on a shared node, "the same address" is
everyone. So strangers (admission.py's ``is_stranger``: no token proven yet; on a store
without a token, no VALIDATE yet) have a budget of their own, per address and in all, and at
its cap the **oldest** stranger makes room for the newest: a flood of half-open connections
only evicts itself, while a real client, which answers in a round trip, is never the oldest
for long. Each stranger must also prove itself within ``admission.ANSWER_TIMEOUT_S`` of its
accept (``overdue``).

No sockets: the intake (intake.py) closes the connections this table gives up, and says why.
Connections are ordered by their accept, which is also the order of their deadlines.
"""

from __future__ import annotations

import collections
from typing import Any, Dict, Generic, List, Optional, Protocol, TypeVar

#: Strangers of one address at once: a node's ranks connecting together are a few hundred at
#: most, each a stranger for a round trip.
MAX_STRANGERS_PER_HOST = 512
#: Strangers of all addresses at once.
MAX_STRANGERS = 8192


class Stranger(Protocol):
    """What the table reads of a connection: its address, and its admission ``gate`` (whose
    ``answer_by`` is when its time to prove itself runs out)."""

    @property
    def host(self) -> str: ...

    @property
    def gate(self) -> Any: ...


C = TypeVar("C", bound=Stranger)


class Strangers(Generic[C]):
    """Connections (``host``, ``gate.answer_by``) that have proven nothing yet, oldest first;
    ``per_host`` and ``total`` are the budget (default MAX_STRANGERS_PER_HOST, MAX_STRANGERS)."""

    def __init__(self, per_host: Optional[int] = None, total: Optional[int] = None):
        per_host = MAX_STRANGERS_PER_HOST if per_host is None else per_host
        total = MAX_STRANGERS if total is None else total
        if per_host < 1 or total < 1:
            raise ValueError(f"the budgets of strangers must be at least 1, got {per_host} per address, {total} in all")
        self.per_host = per_host
        self.total = total
        self._all: "collections.OrderedDict[C, None]" = collections.OrderedDict()
        self._by_host: Dict[str, "collections.OrderedDict[C, None]"] = {}

    def __len__(self) -> int:
        return len(self._all)

    def __contains__(self, conn: object) -> bool:
        return conn in self._all

    def of(self, host: str) -> int:
        """Strangers of ``host`` now."""
        mine = self._by_host.get(host)
        return len(mine) if mine is not None else 0

    def add(self, conn: C) -> None:
        """``conn`` was accepted (after every earlier one): a stranger until ``remove``."""
        self._all[conn] = None
        mine = self._by_host.get(conn.host)
        if mine is None:
            mine = self._by_host[conn.host] = collections.OrderedDict()
        mine[conn] = None

    def remove(self, conn: C) -> bool:
        """``conn`` proved itself, or is closed: no longer counted. Whether it was."""
        if conn not in self._all:
            return False
        del self._all[conn]
        mine = self._by_host[conn.host]
        del mine[conn]
        if not mine:
            del self._by_host[conn.host]
        return True

    def make_room(self, host: str) -> List[C]:
        """Make room for one more stranger of ``host``: the strangers that must go for it,
        oldest first (already removed): the oldest of ``host`` while it has ``per_host``, then
        the oldest of all while there are ``total``."""
        going: List[C] = []
        mine = self._by_host.get(host)
        while mine is not None and len(mine) >= self.per_host:
            oldest = next(iter(mine))
            self.remove(oldest)
            going.append(oldest)
            mine = self._by_host.get(host)
        while len(self._all) >= self.total:
            oldest = next(iter(self._all))
            self.remove(oldest)
            going.append(oldest)
        return going

    def oldest(self) -> Optional[C]:
        """The stranger accepted first (None: none)."""
        return next(iter(self._all)) if self._all else None

    def overdue(self, now: float) -> List[C]:
        """The strangers whose time to prove themselves ended by ``now`` (removed)."""
        going: List[C] = []
        for conn in self._all:
            if conn.gate.answer_by > now:
                break
            going.append(conn)
        for conn in going:
            self.remove(conn)
        return going

    def next_due(self) -> Optional[float]:
        """When the oldest stranger's time runs out (None: no stranger)."""
        oldest = self.oldest()
        return None if oldest is None else oldest.gate.answer_by
