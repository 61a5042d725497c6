"""How connections come and go: accept, the limits on connections, admission (admission.py)
step by step, the deadlines of connections on their way in, closing (and what the log says
about it), and a pause in accepting when the process runs out of file descriptors.

A part of ``StoreServer`` (server.py), as a base class: these methods use the server's
connection tables (``conns``, ``_admitting``, ``_admission_order``), its timers (``_due``),
its ``client_limits``, ``refusals`` and ``tls_handshakes``, and its ``_consume``. Nothing here
runs per request.

* **Admission first.** A new connection is kept apart (``_admitting``) until admission.py has
  taken it through TLS, the token and VALIDATE, within ``admission.TIMEOUT_S`` of the accept;
  only then can its requests run. With no token and no TLS it only checks VALIDATE, and the
  wire is torch's byte for byte.
* **Same-host socket.** Listening on the wildcard address or on loopback, the server also
  listens on the abstract UNIX socket ``net.unix_socket_name(port)``; distlib clients of the
  same user that connect to a loopback address use it (client.py). Same protocol; the
  kernel's cost per request is about a third of TCP loopback's. Peers of another user are
  refused at accept. ``DISTLIB_STORE_UNIX=0`` turns it off.
* **Limits on connections** (budget.ClientLimits): admitted connections in all
  (``max_connections``) and per peer address (``max_connections_per_host``), and connections
  on their way in per address (MAX_ADMITTING_PER_HOST). A connection over one is closed at
  accept, before anything of it is read (and checked again when it is admitted).
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

import errno
import logging
import resource
import socket
import time
from typing import Dict, Optional

from ...deadline import format_duration
from ...net import format_peer, peer_host, same_user, unix_peer
from ...refusals import RefusalLog
from . import admission
from .admission import ADMITTED, WANT_WRITE, Refused
from .connection import CONN_EVENTS, EPOLLIN, EPOLLOUT, IOV_MAX, Connection

log = logging.getLogger("distlib.store.tcp.server")

#: Out of file descriptors: stop accepting this long, then try again.
ACCEPT_PAUSE_S = 0.5
#: ... and log it at most this often.
EMFILE_LOG_INTERVAL_S = 10.0
#: Connections of one address on their way in (TLS, the token, VALIDATE) at once: a node's
#: ranks connecting together are admitted in a round trip or two; past this, a peer is opening
#: connections faster than it finishes them.
MAX_ADMITTING_PER_HOST = 512
#: Connections accepted per loop turn at most: a flood of connections waits in the backlog
#: between turns, and the requests of clients already in run in between.
ACCEPTS_PER_TURN = 128
#: Bytes drained from a connection before its parting reply (see ``_close``).
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
    """Accepting, admitting and closing connections (a base class of ``StoreServer``)."""

    def _accept(self, ep, listener: socket.socket, local: bool = False) -> None:
        tls_handshakes = None if local else self.tls_handshakes
        for _ in range(ACCEPTS_PER_TURN):  # (the listener is level-triggered: the rest come next turn)
            try:
                sock, addr = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE):
                    self._pause_accepting(ep, exc)
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
            conn = Connection(sock, peer, host)
            self._admitting[conn.fd] = conn
            _count(self._admitting_hosts, host, 1)
            deadline = time.monotonic() + admission.TIMEOUT_S
            self.admission.open(conn, local, deadline)
            self._admission_order.append(conn)
            if self._due is None or deadline < self._due:
                self._due = deadline
            if tls_handshakes is not None and self.admission.needs_tls(conn):
                conn.handshaking = True
                tls_handshakes.submit(conn)
                continue
            ep.register(conn.fd, CONN_EVENTS)
            if conn.out:
                self._dirty.append(conn)

    def _over_limit(self, host: str, admitted: bool) -> Optional[str]:
        """Why a connection from ``host`` must be refused now (None: it may come in or stay)."""
        limits = self.client_limits
        if not admitted:
            on_the_way = self._admitting_hosts.get(host, 0)
            if on_the_way >= MAX_ADMITTING_PER_HOST:
                return (f"refused: {on_the_way} connections from {host} are already on their way in (TLS, "
                        f"authentication, VALIDATE), the most one address may have at once")
            if len(self.conns) + len(self._admitting) >= limits.max_connections:
                return (f"refused: the server has {len(self.conns) + len(self._admitting)} connections, its limit "
                        f"(--max-connections {limits.max_connections})")
        elif len(self.conns) >= limits.max_connections:
            return f"refused: the server serves {len(self.conns)} clients, its limit (--max-connections)"
        have = self._hosts.get(host, 0)
        if have >= limits.max_connections_per_host:
            return (f"refused: {host} already has {have} connections, the limit per address "
                    f"(--max-connections-per-host {limits.max_connections_per_host})")
        return None

    def _handshakes_done(self, ep) -> None:
        """Connections the TLS handshake thread handed back: refused ones are closed; the
        others go on to the token or VALIDATE, on the loop."""
        finished = self.tls_handshakes.finished
        while finished:
            conn, refusal = finished.popleft()
            conn.handshaking = False
            if conn.closed:
                continue
            if refusal is None and conn.gate.deadline <= time.monotonic():
                refusal = Refused(f"refused: did not complete the TLS handshake within {admission.TIMEOUT_S:g} s "
                                  f"of connecting")
            if refusal is not None:
                self._close(conn, ep, str(refusal), level=logging.INFO if refusal.quiet else logging.WARNING,
                            reply=refusal.reply)
                continue
            ep.register(conn.fd, CONN_EVENTS)
            if conn.out:
                self._dirty.append(conn)  # the token's challenge
            self._advance(conn, ep, EPOLLIN)  # what arrived behind the handshake

    def _advance(self, conn: Connection, ep, ev: int) -> None:
        """Take a connection on its way in as far as its bytes allow (admission.py); once it is
        admitted, its requests go the usual way."""
        if ev & EPOLLOUT and conn.pending is not None:
            self._flush_pending(conn, ep)
            if conn.closed:
                return
        try:
            outcome = self.admission.advance(conn)
        except Refused as exc:
            self._close(conn, ep, str(exc), level=logging.INFO if exc.quiet else logging.WARNING, reply=exc.reply)
            return
        if conn.out:
            self._dirty.append(conn)
        if outcome == WANT_WRITE:
            ep.modify(conn.fd, CONN_EVENTS | EPOLLOUT)
            return
        if outcome != ADMITTED:
            return
        refusal = self._over_limit(conn.host, admitted=True)
        if refusal is not None:
            self._close(conn, ep, refusal)
            return
        leftover = conn.gate.got
        conn.gate = None
        del self._admitting[conn.fd]
        _count(self._admitting_hosts, conn.host, -1)
        _count(self._hosts, conn.host, 1)
        conn.validated = True
        self.conns[conn.fd] = conn
        if self.log_connections and log.isEnabledFor(logging.INFO):
            self._log_refusal(conn.host, f"client {conn.peer} connected ({len(self.conns)} open)", "connected",
                              logging.INFO, self.connection_log)
        if conn.tls and conn.pending is None:
            ep.modify(conn.fd, CONN_EVENTS)  # the TLS handshake may have asked for EPOLLOUT
        if leftover:
            self._consume(conn, ep, 0, bytes(leftover), len(leftover) + 1)
        if not conn.closed:
            self._unread.append(conn)  # edge-triggered: what followed VALIDATE is read now

    def _timers(self, ep) -> None:
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
            self._close(conn, ep, f"refused: did not complete {self.admission.step_name(conn)} within "
                                  f"{admission.TIMEOUT_S:g} s of connecting")
        if self._accept_paused_until and now >= self._accept_paused_until:
            self._accept_paused_until = 0.0
            for fd in self._listeners:
                ep.register(fd, EPOLLIN)
        for counts in (self.refusals, self.connection_log):
            if counts.due is not None and now >= counts.due:
                counts.flush()
        due = [t for t in (order[0].gate.deadline if order else None, self._accept_paused_until or None,
                           self.refusals.due, self.connection_log.due) if t is not None]
        self._due = min(due) if due else None

    def _log_refusal(self, host: str, text: str, reason: str, level: int = logging.WARNING,
                     counts: Optional[RefusalLog] = None) -> None:
        """Log a refusal of ``host``'s connection, or count it (refusals.py; ``counts``: the
        log of clients' connections instead), and keep the timer that logs the count."""
        counts = counts or self.refusals
        counts.refused(host, text, reason, level)
        due = counts.due
        if due is not None and (self._due is None or due < self._due):
            self._due = due

    def _pause_accepting(self, ep, exc: OSError) -> None:
        """Out of file descriptors: stop accepting for ACCEPT_PAUSE_S (the listeners are
        level-triggered: left in the set, they would report the same connection at once, and
        the loop would spin), and say so at most every EMFILE_LOG_INTERVAL_S."""
        now = time.monotonic()
        for fd in self._listeners:
            try:
                ep.unregister(fd)
            except (OSError, ValueError):
                pass
        self._accept_paused_until = now + ACCEPT_PAUSE_S
        if self._due is None or self._accept_paused_until < self._due:
            self._due = self._accept_paused_until
        if now < self._emfile_log_at:
            self._emfile_unlogged += 1
            return
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        log.error("cannot accept connections: %s (%d clients connected, open-files limit %d); new clients wait in "
                  "the listen backlog, accepting again every %s (this line repeats at most every %s; %d more "
                  "times since the last one)", exc.strerror, len(self.conns) + len(self._admitting), soft,
                  format_duration(ACCEPT_PAUSE_S), format_duration(EMFILE_LOG_INTERVAL_S), self._emfile_unlogged)
        self._emfile_log_at = now + EMFILE_LOG_INTERVAL_S
        self._emfile_unlogged = 0

    def _close(self, conn: Connection, ep, reason: str, level: Optional[int] = logging.WARNING,
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
        elif self._admitting.pop(conn.fd, None) is not None:
            _count(self._admitting_hosts, conn.host, -1)
        self.buffered -= conn.buffered
        conn.buffered = 0
        try:
            ep.unregister(conn.fd)
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
                                             f"({len(self.conns) + len(self._admitting)} open)", reason, level)
        if parting and level is not None:
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
