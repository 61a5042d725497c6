"""How connections come and go: accept, the limits on connections, admission (admission.py)
step by step, the deadlines of connections on their way in, closing (and what the log says
about it), and a pause in accepting when the process runs out of file descriptors.

``Intake`` is one object of the server (server.py). It owns the listening sockets, the tables
of connections (admitted: ``conns``; on their way in: ``admitting``), the deadlines of the
connections on their way in and the logs of refusals (its ``due`` says when ``timers`` must
run next), and it is the one place connections are closed (``close``). It is given the epoll
object, the admission steps, the limits, the state and the memory budget (a closed
connection's waits and bytes are given back), the list of connections with replies to send
(``answered``: a token's challenge) and ``on_admitted``, the server's call for a connection
that came in (with the bytes that followed VALIDATE). Nothing here runs per request.

* **Admission first.** A new connection is kept apart (``admitting``) until admission.py has
  taken it through TLS, the token and VALIDATE, within ``admission.TIMEOUT_S`` of the accept;
  only then can its requests run. With no token and no TLS it only checks VALIDATE, and the
  wire is torch's byte for byte.
* **Same-host socket.** Listening on the wildcard address or on loopback, the server also
  listens on the abstract UNIX socket ``net.unix_socket_name(port)``; distlib clients of the
  same user that connect to a loopback address use it (client.py). Same protocol; the
  kernel's cost per request is about a third of TCP loopback's. Peers of another user are
  refused at accept. ``DISTLIB_STORE_UNIX=0`` turns it off.
* **Limits on connections** (budget.ClientLimits): admitted connections in all
  (``max_connections``) and per peer address (``max_connections_per_host``). A connection
  over one is closed at accept, before anything of it is read (and checked again when it is
  admitted).
* **Strangers make room** (strangers.py): connections that have proven nothing yet (the
  token's response; VALIDATE on a store without a token) have a budget of their own, per
  address and in all, and must prove themselves within ``admission.ANSWER_TIMEOUT_S`` of the
  accept. At the budget's cap (or at ``max_connections``) the oldest stranger is closed to
  make room for the newest, so half-open connections cannot lock a client with the token
  out.
* **The log names each refusal once per address per interval** (distlib/refusals.py): a
  connection refused, timed out on its way in, or closed for what it sent is logged in full
  the first time its address does it, then counted, one line per interval; so a peer that
  opens thousands of bad connections writes a few lines, not thousands.
* **TLS handshakes off the loop** (tls_handshakes.py): a TCP connection to a TLS server goes
  to the handshake thread at accept and comes back with its handshake done (or refused).
* **Out of file descriptors** (EMFILE): the listeners leave the epoll set for
  ACCEPT_PAUSE_S (level-triggered, they would report the same pending connection
  forever), new clients wait in the backlog, and the error is logged at most every
  EMFILE_LOG_INTERVAL_S with the number of refusals since.
"""

from __future__ import annotations

import collections
import errno
import logging
import resource
import socket
import time
from typing import Callable, Deque, Dict, List, Optional

from ...deadline import format_duration
from ...net import format_peer, peer_host, same_user, unix_peer
from ...refusals import RefusalLog
from . import admission
from .admission import ADMITTED, WANT_WRITE, Admission, Refused
from .budget import ClientLimits, MemoryBudget
from .connection import CONN_EVENTS, EPOLLIN, EPOLLOUT, IOV_MAX, Connection
from .state import KeyValueState
from .strangers import Strangers
from .tls_handshakes import TlsHandshakes

log = logging.getLogger("distlib.store.tcp.server")

#: Out of file descriptors: stop accepting this long, then try again.
ACCEPT_PAUSE_S = 0.5
#: ... and log it at most this often.
EMFILE_LOG_INTERVAL_S = 10.0
#: Connections accepted per loop turn at most: a flood of connections waits in the backlog
#: between turns, and the requests of clients already in run in between.
ACCEPTS_PER_TURN = 128
#: Bytes drained from a connection before its parting reply (see ``close``).
_DRAIN = 64 * 1024
#: The address the same-host UNIX socket's clients are counted and logged under.
LOCAL_HOST = "the same-host socket"


def _count(table: Dict[str, int], host: str, delta: int) -> None:
    n = table.get(host, 0) + delta
    if n > 0:
        table[host] = n
    else:
        table.pop(host, None)


class Intake:
    """Accepting, admitting and closing the connections of one store server.

    ``listener`` (and ``local_listener``, the same-host socket, or None) are the server's
    listening sockets, non-blocking; the intake closes them in ``shutdown``.
    """

    def __init__(self, ep, listener: socket.socket, local_listener: Optional[socket.socket],
                 admission_: Admission, client_limits: ClientLimits, state: KeyValueState, budget: MemoryBudget,
                 answered: List[Connection], on_admitted: Callable[[Connection, bytes], None],
                 log_connections: bool = False, strangers: Optional[Strangers[Connection]] = None):
        self.ep = ep
        self.listener = listener
        self.local_listener = local_listener
        self.admission = admission_
        self.client_limits = client_limits
        self.state = state
        self.budget = budget
        self.answered = answered
        self.on_admitted = on_admitted
        self.log_connections = log_connections
        #: Called before a closing connection's last replies are sent (the server's journal
        #: commit: no reply goes out before the change it reports is written).
        self.before_parting: Optional[Callable[[], None]] = None
        #: Listening sockets by fd.
        self.listeners: Dict[int, socket.socket] = {listener.fileno(): listener}
        if local_listener is not None:
            self.listeners[local_listener.fileno()] = local_listener
        self.conns: Dict[int, Connection] = {}  # admitted, by fd
        self.admitting: Dict[int, Connection] = {}  # accepted, not admitted yet (admission.py)
        self._hosts: Dict[str, int] = {}  # peer address -> its admitted connections
        self._admission_order: Deque[Connection] = collections.deque()  # by deadline
        #: Connections on their way in that have proven nothing yet, and their budget.
        self.strangers: Strangers[Connection] = strangers if strangers is not None else Strangers()
        #: Strangers handed to the TLS thread to be refused, and why (it may finish them first).
        self._dropped: Dict[Connection, Refused] = {}
        #: Refusals and closes for what a client sent, logged once per address per interval.
        self.refusals = RefusalLog(log)
        #: With ``log_connections``: clients' connections and disconnections, the same way.
        self.connection_log = RefusalLog(log, noun="connections and disconnections")
        #: The TLS handshake thread (tls_handshakes.py), while serving with TLS.
        self.tls_handshakes: Optional[TlsHandshakes] = None
        #: When ``timers`` must run next: an admission deadline, accepting again, a count of
        #: refusals to log (None: nothing due).
        self.due: Optional[float] = None
        self._accept_paused_until = 0.0
        self._emfile_log_at = 0.0
        self._emfile_unlogged = 0

    # -- serving -----------------------------------------------------------------------------------

    def start(self, wake: Callable[[], None], name: str) -> None:
        """Serving begins: the listeners join the epoll set, and the TLS handshake thread starts
        when the server has a certificate (``wake`` is its call back to the loop)."""
        for fd in self.listeners:
            self.ep.register(fd, EPOLLIN)
        if self.admission.tls_context is not None:
            self.tls_handshakes = TlsHandshakes(self.admission, wake, name)

    def shutdown(self) -> None:
        """Serving ends: close the listeners first (a client that reconnects when its connection
        closes is refused then, and waits for the next server, instead of being accepted by
        this one on its way out), stop the TLS thread, close every connection, log the last
        counts of refusals."""
        self.close_listeners()
        if self.tls_handshakes is not None:
            self.tls_handshakes.close()
        for conn in list(self.conns.values()) + list(self.admitting.values()):
            self.close(conn, "server stopping", level=None)
        self.refusals.flush(final=True)
        self.connection_log.flush(final=True)

    def close_listeners(self) -> None:
        self.listener.close()
        if self.local_listener is not None:
            self.local_listener.close()

    def admitted_from(self, host: str) -> int:
        """Admitted connections of ``host`` (an address, without the port)."""
        return self._hosts.get(host, 0)

    def strangers_from(self, host: str) -> int:
        """Connections of ``host`` on their way in that have proven nothing yet."""
        return self.strangers.of(host)

    def accept(self, fd: int) -> None:
        """The listening socket ``fd`` is readable: accept what waits (ACCEPTS_PER_TURN at most)."""
        listener = self.listeners[fd]
        local = listener is self.local_listener
        tls_handshakes = None if local else self.tls_handshakes
        for _ in range(ACCEPTS_PER_TURN):  # (the listener is level-triggered: the rest come next turn)
            try:
                sock, addr = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE):
                    self._pause_accepting(exc)
                    return
                if exc.errno in (errno.ECONNABORTED, errno.EPROTO):
                    continue
                raise
            sock.setblocking(False)
            if local:
                peer = unix_peer(sock)
                host = LOCAL_HOST
                refusal = same_user(sock)
                if refusal is not None:
                    self._log_refusal(host, f"refused same-host client {peer}: it is {refusal}", refusal)
                    sock.close()
                    continue
            else:
                try:
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                except OSError:
                    pass
                peer = format_peer(addr)
                host = peer_host(addr)
            refusal = self._over_limit(host, admitted=False)
            if refusal is not None:
                self._log_refusal(host, f"closed connection of client {peer}: {refusal}", refusal)
                sock.close()
                continue
            self._make_room(host)
            conn = Connection(sock, peer, host)
            self.admitting[conn.fd] = conn
            self.admission.open(conn, local, time.monotonic())
            self._admission_order.append(conn)
            self.strangers.add(conn)
            gate = conn.gate
            assert gate is not None  # (admission.open set it)
            first = min(gate.deadline, gate.answer_by)
            if self.due is None or first < self.due:
                self.due = first
            if tls_handshakes is not None and self.admission.needs_tls(conn):
                conn.handshaking = True
                tls_handshakes.submit(conn)
                continue
            self.ep.register(conn.fd, CONN_EVENTS)
            if conn.out:
                self.answered.append(conn)

    def _over_limit(self, host: str, admitted: bool) -> Optional[str]:
        """Why a connection from ``host`` must be refused now (None: it may come in or stay)."""
        limits = self.client_limits
        if not admitted:
            if len(self.conns) + len(self.admitting) >= limits.max_connections and not self.strangers:
                return (f"refused: the server has {len(self.conns) + len(self.admitting)} connections, its limit "
                        f"(--max-connections {limits.max_connections})")
        elif len(self.conns) >= limits.max_connections:
            return f"refused: the server serves {len(self.conns)} clients, its limit (--max-connections)"
        have = self._hosts.get(host, 0)
        if have >= limits.max_connections_per_host:
            return (f"refused: {host} already has {have} connections, the limit per address "
                    f"(--max-connections-per-host {limits.max_connections_per_host})")
        return None

    def _make_room(self, host: str) -> None:
        """A connection of ``host`` is coming in: close the oldest strangers if the budget of
        strangers (strangers.py) or ``max_connections`` has no room for it."""
        strangers = self.strangers
        for old in strangers.make_room(host):
            if old.host == host and strangers.of(host) + 1 >= strangers.per_host:
                why = (f"{strangers.per_host} connections of {host} had proven nothing yet, the most one address "
                       f"may have at once")
            else:
                why = f"{strangers.total} connections had proven nothing yet, the most the server holds at once"
            self._refuse_stranger(old, f"refused: made room for a newer connection: "
                                       f"{self.admission.unproven(old)} had not come, and {why} (the oldest goes)")
        limit = self.client_limits.max_connections
        while len(self.conns) + len(self.admitting) - len(self._dropped) >= limit:
            oldest = strangers.oldest()
            if oldest is None:
                break
            strangers.remove(oldest)
            self._refuse_stranger(oldest, f"refused: made room for a newer connection: "
                                          f"{self.admission.unproven(oldest)} had not come, and the server has "
                                          f"{limit} connections, its limit (--max-connections {limit}) (the oldest "
                                          f"that proved nothing goes)")

    def _refuse_stranger(self, conn: Connection, reason: str) -> None:
        """Close a stranger (already out of ``strangers``); one in its TLS handshake is handed
        back by the handshake thread first (it owns the socket until then)."""
        if conn.handshaking and self.tls_handshakes is not None:
            refusal = Refused(reason)
            self._dropped[conn] = refusal
            self.tls_handshakes.drop(conn, refusal)
        else:
            self.close(conn, reason)

    def handshakes_done(self) -> None:
        """Connections the TLS handshake thread handed back: refused ones are closed; the
        others go on to the token or VALIDATE, on the loop."""
        assert self.tls_handshakes is not None, "started with TLS"
        finished = self.tls_handshakes.finished
        while finished:
            conn, refusal = finished.popleft()
            conn.handshaking = False
            dropped = self._dropped.pop(conn, None)
            if conn.closed:
                continue
            if refusal is None:
                refusal = dropped  # (its handshake ended before the thread saw the drop)
            if refusal is None and conn.gate.deadline <= time.monotonic():
                refusal = Refused(f"refused: did not complete the TLS handshake within {admission.TIMEOUT_S:g} s "
                                  f"of connecting")
            if refusal is not None:
                self.close(conn, str(refusal), level=logging.INFO if refusal.quiet else logging.WARNING,
                           reply=refusal.reply)
                continue
            self.ep.register(conn.fd, CONN_EVENTS)
            if conn.out:
                self.answered.append(conn)  # the token's challenge
            self.advance(conn)  # what arrived behind the handshake

    def advance(self, conn: Connection) -> None:
        """Take a connection on its way in as far as its bytes allow (admission.py); once it is
        admitted, the server's ``on_admitted`` has it (its requests go the usual way)."""
        try:
            outcome = self.admission.advance(conn)
        except Refused as exc:
            self.close(conn, str(exc), level=logging.INFO if exc.quiet else logging.WARNING, reply=exc.reply)
            return
        if conn.out:
            self.answered.append(conn)
        if outcome == WANT_WRITE:
            self.ep.modify(conn.fd, CONN_EVENTS | EPOLLOUT)
            return
        if outcome != ADMITTED:
            if not self.admission.is_stranger(conn):
                self.strangers.remove(conn)  # it proved the token
            return
        self.strangers.remove(conn)
        refusal = self._over_limit(conn.host, admitted=True)
        if refusal is not None:
            self.close(conn, refusal)
            return
        assert conn.gate is not None, "admitted once, through its gate"
        leftover = conn.gate.got
        conn.gate = None
        del self.admitting[conn.fd]
        _count(self._hosts, conn.host, 1)
        conn.validated = True
        self.conns[conn.fd] = conn
        if self.log_connections and log.isEnabledFor(logging.INFO):
            self._log_refusal(conn.host, f"client {conn.peer} connected ({len(self.conns)} open)", "connected",
                              logging.INFO, self.connection_log)
        if conn.tls and conn.pending is None:
            self.ep.modify(conn.fd, CONN_EVENTS)  # the TLS handshake may have asked for EPOLLOUT
        self.on_admitted(conn, bytes(leftover))

    def timers(self) -> None:
        """Close connections still on their way in at their deadline; accept again after a
        pause; log the counts of refusals whose interval ended."""
        now = time.monotonic()
        order = self._admission_order
        while order:
            conn = order[0]
            gate = conn.gate
            if gate is None or conn.closed:
                order.popleft()
                continue
            if gate.deadline > now:
                break
            order.popleft()
            if conn.handshaking:
                continue  # the handshake thread refuses it at this deadline (tls_handshakes.py)
            self.close(conn, f"refused: did not complete {self.admission.step_name(conn)} within "
                             f"{admission.TIMEOUT_S:g} s of connecting")
        for conn in self.strangers.overdue(now):
            self._refuse_stranger(conn, f"refused: {self.admission.unproven(conn)} did not come within "
                                        f"{admission.ANSWER_TIMEOUT_S:g} s of connecting")
        if self._accept_paused_until and now >= self._accept_paused_until:
            self._accept_paused_until = 0.0
            for fd in self.listeners:
                self.ep.register(fd, EPOLLIN)
        for counts in (self.refusals, self.connection_log):
            if counts.due is not None and now >= counts.due:
                counts.flush()
        due = [t for t in (order[0].gate.deadline if order and order[0].gate is not None else None, self.strangers.next_due(),
                           self._accept_paused_until or None, self.refusals.due, self.connection_log.due)
               if t is not None]
        self.due = min(due) if due else None

    def _log_refusal(self, host: str, text: str, reason: str, level: int = logging.WARNING,
                     counts: Optional[RefusalLog] = None) -> None:
        """Log a refusal of ``host``'s connection, or count it (refusals.py; ``counts``: the
        log of clients' connections instead), and keep the timer that logs the count."""
        counts = counts or self.refusals
        counts.refused(host, text, reason, level)
        due = counts.due
        if due is not None and (self.due is None or due < self.due):
            self.due = due

    def _pause_accepting(self, exc: OSError) -> None:
        """Out of file descriptors: stop accepting for ACCEPT_PAUSE_S (the listeners are
        level-triggered: left in the set, they would report the same connection at once, and
        the loop would spin), and say so at most every EMFILE_LOG_INTERVAL_S."""
        now = time.monotonic()
        for fd in self.listeners:
            try:
                self.ep.unregister(fd)
            except (OSError, ValueError):
                pass
        self._accept_paused_until = now + ACCEPT_PAUSE_S
        if self.due is None or self._accept_paused_until < self.due:
            self.due = self._accept_paused_until
        if now < self._emfile_log_at:
            self._emfile_unlogged += 1
            return
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        log.error("cannot accept connections: %s (%d clients connected, open-files limit %d); new clients wait in "
                  "the listen backlog, accepting again every %s (this line repeats at most every %s; %d more "
                  "times since the last one)", exc.strerror, len(self.conns) + len(self.admitting), soft,
                  format_duration(ACCEPT_PAUSE_S), format_duration(EMFILE_LOG_INTERVAL_S), self._emfile_unlogged)
        self._emfile_log_at = now + EMFILE_LOG_INTERVAL_S
        self._emfile_unlogged = 0

    def close(self, conn: Connection, reason: str, level: Optional[int] = logging.WARNING,
              reply: bytes = b"") -> None:
        """Close ``conn``; log ``reason`` at ``level`` (None: not at all; "disconnected" and
        INFO: only when the server logs connections; a WARNING once per address per interval,
        refusals.py), then send (best effort) the replies its earlier requests of this turn
        produced and ``reply``, and close: a bad request answers nothing, and the good ones
        before it are answered however the bytes were cut into reads."""
        if conn.closed:
            return
        conn.closed = True
        parting = conn.out if conn.pending is None else []
        if reply:
            parting.append(reply)
        conn.out = []  # nothing more to send (_flush skips it)
        conn.inbuf = conn.held = conn.pending = conn.scan = None  # freed now, whoever still lists conn
        self.state.cancel(conn)
        if self.conns.pop(conn.fd, None) is not None:
            _count(self._hosts, conn.host, -1)
        elif self.admitting.pop(conn.fd, None) is not None:
            self.strangers.remove(conn)
            self._dropped.pop(conn, None)
        self.budget.discharge(conn)
        try:
            self.ep.unregister(conn.fd)
        except (OSError, ValueError):
            pass
        if level is not None:  # log first: the log line should exist by the time the client sees EOF
            if reason == "disconnected" or level < logging.WARNING:
                if not self.log_connections or not log.isEnabledFor(logging.INFO):
                    pass
                elif conn.validated:
                    self._log_refusal(conn.host, f"client {conn.peer} {reason} ({len(self.conns)} open)", reason,
                                      logging.INFO, self.connection_log)
                else:
                    self._log_refusal(conn.host, f"client {conn.peer} {reason}", reason, level=logging.INFO)
            else:
                self._log_refusal(conn.host, f"closed connection of client {conn.peer}: {reason} "
                                             f"({len(self.conns) + len(self.admitting)} open)", reason, level)
        if parting and level is not None:
            if self.before_parting is not None:
                self.before_parting()
            # Unread input would make close() send a reset, which can destroy what was sent
            # before the peer reads it: drain what arrived (bounded), then send.
            try:
                for _ in range(4):
                    if not conn.sock.recv(_DRAIN):
                        break
            except OSError:
                pass
            try:
                conn.sock.sendmsg(parting[:IOV_MAX]) if len(parting) > 1 else conn.sock.send(parting[0])
            except OSError:
                pass
        conn.sock.close()
