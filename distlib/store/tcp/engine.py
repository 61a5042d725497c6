"""``RequestEngine``: a connection's requests, from the bytes that arrived to the replies, with
no sockets.

The server's loop (server.py) reads a connection and hands what one ``recv()`` returned to
``feed``; the engine frames the requests (a request that has not fully arrived waits for the
bytes it needs), runs each through its handler (handlers.py) on the key-value state
(state.py), and leaves the replies on the connection (``conn.out``), listing the connection in
``answered``. What it cannot run yet it holds: requests queued behind a pending WAIT (ordered
waits, codec.py), the rest of a read while the connection's replies wait to go out
(backpressure: ``conn.paused``). The loop sends what ``answered`` lists, and calls back:
``run_released`` when waits completed (``released``), ``run_kept`` when the replies of a
paused connection are out. The fuzz test (tests/store/test_request_fuzz.py) drives the same
methods with bytes of its own.

A request the protocol cannot answer (malformed, refused by the state, a verdict of a
handler) raises ``CloseConnection`` with the reason; the replies of the requests before it are
still on ``conn.out`` (the server sends them as it closes: the protocol has no error reply).

What the engine holds for a connection (a request that has not fully arrived, requests held
behind a wait) is charged to the memory budget (budget.py); the server enforces the budget
after each call, since closing the connections that hold the most is I/O.

Every change to the stored data goes through ``self.state``'s methods, called by the handlers
and the batch path (batch.py): a server with a state directory uses a state whose methods
also journal the change (journaled_state.py).
"""

from __future__ import annotations

import collections
from typing import Callable, List, Optional

from . import codec
from .budget import ClientLimits, MemoryBudget
from .codec import MANY_KEY_OPS, STOP_WAITING, U64, Limits, ManyScan, Op, ProtocolError
from .connection import Connection
from .handlers import CloseConnection, Handlers
from .incarnation import new_incarnation
from .journal import Journal
from .sequence import SEQUENCE_HEADER_BYTES, SEQUENCE_PREFIX
from .journal_records import Image
from .journaled_state import JournaledState
from .observe import Observer, observed_table
from .state import KeyValueState, StateError

#: A connection's requests stop running for the turn once this many reply parts wait to go out
#: (a part is at most handlers.COPY_MAX bytes, or a stored value sent by reference).
MAX_OUT_PARTS = 64
#: Requests one connection may queue behind a pending WAIT (a distlib client queues one: its
#: GET; torch clients none).
MAX_HELD_REQUESTS = 64

_STOP = bytes([STOP_WAITING])
_CANCEL_WAIT = int(Op.CANCEL_WAIT)
_WAIT = int(Op.WAIT)


class RequestEngine:
    """Bytes in, replies out, waits held: the per-connection request path of one server.

    It owns what the server holds for its clients: ``state`` (the keys, values and waits,
    told to release waits through ``wait_released``), ``handlers`` (one per opcode) and
    ``budget`` (the memory budget: ``memory_budget`` bytes, the requests the engine holds and
    the waits of the state counted in it; the server's sending charges it too).
    ``client_limits`` caps the keys waited for; ``on_worker(conn, value)`` is told of each ADD
    on the worker counter ``init/`` (handlers.py); ``observer`` (observe.py), of every request.
    With a ``journal`` (journal.py), the state starts from ``image`` (what it replayed) and
    records every change in it; the loop commits it before sending a turn's replies.
    """

    def __init__(self, limits: Limits, client_limits: ClientLimits, memory_budget: int,
                 on_worker: Callable[[Connection, int], None], observer: Optional[Observer] = None,
                 journal: Optional[Journal] = None, image: Optional[Image] = None):
        self.limits = limits
        #: Connections with replies on ``conn.out`` since the loop last took them (sent at the
        #: end of its turn); a connection may be listed more than once.
        self.answered: List[Connection] = []
        #: Connections whose wait completed while requests were held behind it (``run_released``).
        self.released: List[Connection] = []
        state_args = (self.wait_released, limits.max_value, client_limits.max_wait_keys_per_client,
                      client_limits.max_wait_keys)
        if journal is None:
            self.state = KeyValueState(*state_args)  # type: ignore[arg-type]  # its Waiters are Connections
        else:  # every change also journaled (journaled_state.py), starting from what was replayed
            self.state = JournaledState(journal, image or Image(), *state_args)  # type: ignore[arg-type]
        self.budget = MemoryBudget(memory_budget, self.state)
        # Which state this is (incarnation.py): the journal's, else a new one for this process.
        incarnation = journal.incarnation if journal is not None else new_incarnation()
        self.handlers = Handlers(self.state, limits, on_worker,  # type: ignore[arg-type]  # (its conns: ours)
                                 incarnation)
        # One entry per opcode byte: parse the request at buf[pos:end] and run it; return the
        # offset after it, or -need when it has not fully arrived.
        self._ops = self.handlers.table()
        if observer is not None:  # each request also told to an observer (observe.py)
            self._ops = observed_table(self._ops, observer, limits)

    # -- the loop's calls --------------------------------------------------------------------------

    def feed(self, conn: Connection, data: bytes) -> bool:
        """Run the requests that ``data`` (the next bytes of ``conn``, non-empty) completes.

        Returns False when the connection must not be read on now: the rest of ``data`` waits
        for its replies to go out (``conn.paused``). Raises CloseConnection.
        """
        if conn.inbuf is not None:
            whole = self._complete(conn, data)
            if whole is None:
                return True
            data = whole
        consumed, end = 0, len(data)
        try:  # the loop of requests, inline (this runs once per request)
            ops = self._ops
            while consumed < end:
                if conn.wait_count or conn.held:
                    r = self._hold(conn, data, consumed, end)
                else:
                    r = ops[data[consumed]](conn, data, consumed, end)
                if r < 0:
                    conn.need = -r
                    break
                consumed = r
                if consumed < end and len(conn.out) > MAX_OUT_PARTS:  # backpressure (_keep)
                    conn.paused = True
                    conn.need = 0
                    break
        except ProtocolError as exc:
            raise CloseConnection(f"malformed request: {exc}") from None
        except StateError as exc:
            raise CloseConnection(str(exc)) from None
        go_on = True
        if consumed < end:
            go_on = self._keep(conn, data, consumed)
        if conn.out:
            self.answered.append(conn)  # sent at the end of the loop turn
        return go_on

    def run_kept(self, conn: Connection) -> bool:
        """``conn``'s replies went out (``conn.paused`` cleared): run the requests it kept
        meanwhile. Returns whether the connection may be read on. Raises CloseConnection."""
        inbuf = conn.inbuf
        if inbuf is None or conn.need != 0:
            return True
        conn.inbuf = None
        self.budget.charge(conn, -len(inbuf))
        return self.feed(conn, bytes(inbuf))

    def take_released(self) -> List[Connection]:
        """The connections ``released`` lists, and an empty list in its place."""
        released, self.released = self.released, []
        return released

    def run_held(self, conn: Connection) -> None:
        """Run the requests that queued behind ``conn``'s wait, now complete, in order, until
        one of them waits again. Raises CloseConnection."""
        held = conn.held
        ops = self._ops
        charge = self.budget.charge
        try:
            while held and not conn.wait_count:
                request = held.popleft()
                charge(conn, -len(request))
                ops[request[0]](conn, request, 0, len(request))
        except ProtocolError as exc:
            raise CloseConnection(f"malformed request: {exc}") from None
        except StateError as exc:
            raise CloseConnection(str(exc)) from None
        if not held:
            conn.held = None
        if conn.out:
            self.answered.append(conn)

    def wait_released(self, conn: Connection) -> None:
        """The state released ``conn``'s wait (``KeyValueState.on_release``): its STOP_WAITING
        goes out this turn, before any later reply of the connection; the requests held
        behind the wait run in ``run_released``."""
        conn.out.append(_STOP)
        self.answered.append(conn)
        if conn.held:
            self.released.append(conn)

    # -- framing -----------------------------------------------------------------------------------

    def _complete(self, conn: Connection, data: bytes) -> Optional[bytes]:
        """Add ``data`` to the request that has not fully arrived; the buffer once it has (the
        request first), else None."""
        inbuf = conn.inbuf
        assert inbuf is not None  # (the caller's check)
        inbuf += data
        self.budget.charge(conn, len(data))
        if len(inbuf) < conn.need:
            return None
        scan = conn.scan
        if scan is not None:
            try:
                r = scan.advance(inbuf, len(inbuf))
            except ProtocolError as exc:
                raise CloseConnection(f"malformed request: {exc}") from None
            if r < 0:
                conn.need = -r
                return None
            conn.scan = None
        conn.inbuf = None
        self.budget.charge(conn, -len(inbuf))
        return bytes(inbuf)

    def _keep(self, conn: Connection, data: bytes, consumed: int) -> bool:
        """Keep ``data[consumed:]``: a request that has not fully arrived, or requests that wait
        for the connection's replies to go out (``conn.paused``). Returns whether to read on."""
        rest = bytearray(memoryview(data)[consumed:])
        conn.inbuf = rest
        self.budget.charge(conn, len(rest))
        if not conn.paused:
            conn.need -= consumed
            header = SEQUENCE_HEADER_BYTES  # a numbered MULTI_SET: scanned from after its header
            if len(rest) > header and rest[header] in MANY_KEY_OPS and rest.startswith(SEQUENCE_PREFIX):
                conn.scan = ManyScan(rest[header], self.limits, header)
                try:
                    conn.need = -conn.scan.advance(rest, len(rest))
                except ProtocolError as exc:
                    raise CloseConnection(f"malformed request: {exc}") from None
            elif rest[0] in MANY_KEY_OPS:  # its end is found by one pass over what arrives
                state = self.state
                if rest[0] == _WAIT and len(rest) >= 9 and U64.unpack_from(rest, 1)[0] > state.max_wait_keys:
                    # over the cap: refused now, not after tens of megabytes of keys arrive
                    raise CloseConnection(str(state.too_many_keys(U64.unpack_from(rest, 1)[0])))
                conn.scan = ManyScan(rest[0], self.limits)
                try:
                    conn.need = -conn.scan.advance(rest, len(rest))
                except ProtocolError as exc:
                    raise CloseConnection(f"malformed request: {exc}") from None
        return not conn.paused

    def _hold(self, conn: Connection, buf: bytes, pos: int, end: int) -> int:
        """Ordered waits: a request behind a pending wait queues up (as its raw bytes);
        CANCEL_WAIT ends the wait at once and lets the queued requests run, in order,
        before new ones."""
        if buf[pos] == _CANCEL_WAIT and conn.wait_count:
            self.handlers.cancel_wait(conn)
            r = pos + 1
        else:
            r = codec.request_end(buf, pos, end, self.limits)
            if r < 0:
                return r
            if conn.held is None:
                conn.held = collections.deque()
            elif len(conn.held) >= MAX_HELD_REQUESTS:
                raise CloseConnection(f"more than {MAX_HELD_REQUESTS} requests queued behind a pending WAIT")
            request = buf[pos:r]
            conn.held.append(request)
            self.budget.charge(conn, len(request))
        if not conn.wait_count:
            self.run_held(conn)
        return r
