"""How connections come in: accept, admission (admission.py) step by step, the deadlines of
connections on their way in, and a pause in accepting when the process runs out of file
descriptors.

A part of ``StoreServer`` (server.py), as a base class: these methods use the server's
connection tables (``conns``, ``_admitting``, ``_admission_order``), its timers (``_due``)
and its ``_close``/``_consume``. Nothing here runs per request.

* **Admission first.** A new connection is kept apart (``_admitting``) until admission.py has
  taken it through TLS, the token and VALIDATE, within ``admission.TIMEOUT_S`` of the accept;
  only then can its requests run. With no token and no TLS it only checks VALIDATE, and the
  wire is torch's byte for byte.
* **Same-host socket.** Listening on the wildcard address or on loopback, the server also
  listens on the abstract UNIX socket ``net.unix_socket_name(port)``; distlib clients of the
  same user that connect to a loopback address use it (client.py). Same protocol; the
  kernel's cost per request is about a third of TCP loopback's. Peers of another user are
  refused at accept. ``DISTLIB_STORE_UNIX=0`` turns it off.
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

from ...deadline import format_duration
from ...net import format_peer, same_user, unix_peer
from . import admission
from .admission import ADMITTED, WANT_WRITE, Refused
from .connection import CONN_EVENTS, EPOLLIN, EPOLLOUT, Connection

log = logging.getLogger("distlib.store.tcp.server")

#: Out of file descriptors: stop accepting this long, then try again.
ACCEPT_PAUSE_S = 0.5
#: ... and log it at most this often.
EMFILE_LOG_INTERVAL_S = 10.0


class Intake:
    """Accepting and admitting connections (a base class of ``StoreServer``)."""

    def _accept(self, ep, listener: socket.socket, local: bool = False) -> None:
        while True:
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
                refusal = same_user(sock)
                if refusal is not None:
                    log.warning("refused same-host client %s: it is %s", peer, refusal)
                    sock.close()
                    continue
            else:
                try:
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                except OSError:
                    pass
                peer = format_peer(addr)
            conn = Connection(sock, peer)
            self._admitting[conn.fd] = conn
            ep.register(conn.fd, CONN_EVENTS)
            deadline = time.monotonic() + admission.TIMEOUT_S
            self.admission.open(conn, local, deadline)
            self._admission_order.append(conn)
            if self._due is None or deadline < self._due:
                self._due = deadline
            if conn.out:
                self._dirty.append(conn)
            if self.log_connections:
                log.info("client %s connected (%d open)", conn.peer, len(self.conns) + len(self._admitting))

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
        leftover = conn.gate.got
        conn.gate = None
        del self._admitting[conn.fd]
        conn.validated = True
        self.conns[conn.fd] = conn
        if conn.tls and conn.pending is None:
            ep.modify(conn.fd, CONN_EVENTS)  # the TLS handshake may have asked for EPOLLOUT
        if leftover:
            self._consume(conn, ep, 0, bytes(leftover), len(leftover) + 1)
        if not conn.closed:
            self._unread.append(conn)  # edge-triggered: what followed VALIDATE is read now

    def _timers(self, ep) -> None:
        """Close connections still on their way in at their deadline; accept again after a pause."""
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
            self._close(conn, ep, f"refused: did not complete {self.admission.step_name(conn)} within "
                                  f"{admission.TIMEOUT_S:g} s of connecting")
        if self._accept_paused_until and now >= self._accept_paused_until:
            self._accept_paused_until = 0.0
            for fd in self._listeners:
                ep.register(fd, EPOLLIN)
        due = [t for t in (order[0].gate.deadline if order else None, self._accept_paused_until or None)
               if t is not None]
        self._due = min(due) if due else None

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
