"""The server's one memory budget: what it allocates for its clients, counted per connection,
and the connections closed, largest first, when the total passes it.

Counted: unsent replies (the server's own bytes; stored values sent by reference are the
store's memory, not the client's), requests that have not fully arrived, requests queued
behind a wait. Past ``memory_budget`` the connections holding the most are closed, largest
first, with a log line each (as Redis evicts clients past ``maxmemory-clients``).

A part of ``StoreServer`` (server.py), as a base class: it uses the server's ``conns``,
``buffered``, ``memory_budget`` and ``_close``.
"""

from __future__ import annotations

from operator import attrgetter

from .connection import Connection

#: What the server may hold for its clients in all (unsent replies, requests not fully arrived
#: or queued behind a wait) before it closes the connections holding the most. A single request
#: larger than this cannot be served.
MEMORY_BUDGET = 1024 * 1024 * 1024

_buffered_of = attrgetter("buffered")


class MemoryBudget:
    """Charging connections and evicting the largest (a base class of ``StoreServer``)."""

    def _charge(self, conn: Connection, n: int) -> None:
        conn.buffered += n
        self.buffered += n

    def _check_budget(self, ep) -> None:
        if self.buffered > self.memory_budget:
            self._evict(ep)

    def _evict(self, ep) -> None:
        """Over the budget: close the connections holding the most until under it again."""
        holders = sorted((c for c in self.conns.values() if c.buffered), key=_buffered_of, reverse=True)
        for conn in holders:
            if self.buffered <= self.memory_budget:
                return
            held = sum(map(len, conn.held or ()))
            partial = len(conn.inbuf) if conn.inbuf is not None else 0
            self._close(conn, ep, (
                f"evicted: the server holds {self.buffered} bytes for its clients, over its memory budget of "
                f"{self.memory_budget}, and this client the most: {conn.pending_own} bytes of replies it has not "
                f"read, {partial} of requests that have not fully arrived or wait for those replies, {held} "
                f"queued behind a WAIT"))
