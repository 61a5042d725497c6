"""The server's one memory budget: what it allocates for its clients, counted per connection,
and the connections closed, largest first, when the total passes it.

Counted: unsent replies (the server's own bytes; stored values sent by reference are the
store's memory, not the client's), requests that have not fully arrived, requests queued
behind a wait (``Connection.buffered``), and what each pending WAIT or BARRIER holds per key
(the state's ``wait_bytes``; a connection's share is ``state.cost_of(conn)``: state.py). Past
``memory_budget`` the connections holding the most are closed, largest first, with a log line
each (as Redis evicts clients past ``maxmemory-clients``).

Checked where a connection's buffers grow and once at the end of every loop turn (waits grow
inside the handlers and the batch path, which do not know the budget; a turn adds at most one
request's worth per connection, and a WAIT's keys are capped by the state).

``MemoryBudget`` is one object, owned by the request engine (engine.py: what it holds for a
connection, the state's waits) and charged by the sending too (sending.py: unsent replies).
It counts and chooses; closing the connections it chooses is the caller's (``evict``'s
``close``), since that is I/O.
"""

from __future__ import annotations

from typing import Callable, Iterable

from .connection import Connection
from .state import MAX_WAIT_KEYS, MAX_WAITING_KEYS, KeyValueState

#: What the server may hold for its clients in all (unsent replies, requests not fully arrived
#: or queued behind a wait, the keys of pending waits) before it closes the connections holding
#: the most. A single request larger than this cannot be served.
MEMORY_BUDGET = 1024 * 1024 * 1024
#: Clients (admitted connections) the server serves at once, in all; never more than the
#: open-files limit allows (the server raises its soft limit to the hard limit at start).
MAX_CONNECTIONS = 65536
#: Clients from one address (a host's ranks, its probes, its launcher): a node of a job has
#: hundreds at most; the store benchmark runs 4096 ranks on one host.
MAX_CONNECTIONS_PER_HOST = 8192


class ClientLimits:
    """What the server's clients may hold at once, besides memory (``memory_budget``): admitted
    connections in all and per peer address, keys one connection may wait for, distinct keys
    waited for in all. A connection over a connection limit is refused; a WAIT over a key cap
    closes its connection (state.py); each is named in the log (refusals.py)."""

    __slots__ = ("max_connections", "max_connections_per_host", "max_wait_keys_per_client", "max_wait_keys")

    def __init__(self, max_connections: int = MAX_CONNECTIONS,
                 max_connections_per_host: int = MAX_CONNECTIONS_PER_HOST,
                 max_wait_keys_per_client: int = MAX_WAIT_KEYS, max_wait_keys: int = MAX_WAITING_KEYS):
        for name, value in (("max_connections", max_connections),
                            ("max_connections_per_host", max_connections_per_host),
                            ("max_wait_keys_per_client", max_wait_keys_per_client), ("max_wait_keys", max_wait_keys)):
            if value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        self.max_connections = max_connections
        self.max_connections_per_host = max_connections_per_host
        self.max_wait_keys_per_client = max_wait_keys_per_client
        self.max_wait_keys = max_wait_keys



class MemoryBudget:
    """What the server holds for its clients, counted against ``limit`` bytes: ``buffered``
    (each connection's ``Connection.buffered``, charged with ``charge``) plus the waits of
    ``state`` (``state.wait_bytes``)."""

    __slots__ = ("limit", "state", "buffered")

    def __init__(self, limit: int, state: KeyValueState):
        self.limit = limit
        self.state = state
        self.buffered = 0  # what every connection holds (Connection.buffered), in bytes

    def charge(self, conn: Connection, n: int) -> None:
        """``conn`` holds ``n`` more bytes (fewer when negative)."""
        conn.buffered += n
        self.buffered += n

    def discharge(self, conn: Connection) -> None:
        """``conn`` is closed: what it held is freed."""
        self.buffered -= conn.buffered
        conn.buffered = 0

    def over(self) -> bool:
        """Whether the server holds more than ``limit`` for its clients."""
        return self.buffered + self.state.wait_bytes > self.limit

    def evict(self, conns: Iterable[Connection], close: Callable[[Connection, str], None]) -> None:
        """Over the budget: ``close`` the connections of ``conns`` holding the most, with the
        reason, until under it again (``close`` must ``discharge`` them)."""
        state = self.state
        holding = {conn: conn.buffered + state.cost_of(conn) for conn in conns if conn.buffered or conn.wait_count}
        for conn in sorted(holding, key=holding.__getitem__, reverse=True):
            held_now = self.buffered + state.wait_bytes
            if held_now <= self.limit:
                return
            held = sum(map(len, conn.held or ()))
            partial = len(conn.inbuf) if conn.inbuf is not None else 0
            cost = state.cost_of(conn)
            waiting = f", about {cost} for the {conn.wait_count} keys it waits for" if cost else ""
            close(conn, (
                f"evicted: the server holds {held_now} bytes for its clients, over its memory budget of "
                f"{self.limit} (--memory-budget-mb), and this client the most: {conn.pending_own} bytes of "
                f"replies it has not read, {partial} of requests that have not fully arrived or wait for those "
                f"replies, {held} queued behind a WAIT{waiting}"))
