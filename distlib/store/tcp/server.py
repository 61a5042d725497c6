"""``StoreServer``: the TCPStore server, one epoll loop, for torch and distlib clients alike.

Used in two ways: ``TCPStore(is_master=True)`` runs it on a daemon thread (as torch runs its
server thread), and ``distlib store-server`` runs it as the standalone TCP master service
that any number of jobs share.

This module is the event loop, reading and running requests. What a request does is
handlers.py (decode with codec.py, run on the state of state.py, queue the reply); who gets in
(same-user check, TLS, the token, VALIDATE, the time allowed, the limits on connections) is
admission.py, driven by intake.py, with TLS handshakes on tls_handshakes.py's thread; replies
go out through sending.py; the memory budget is budget.py; a connection's fields are
connection.py; the barrier's shape has its own path, batch.py. Design, and why:

* **One thread, non-blocking sockets, epoll** (the batch path adds helper threads that only
  send a large turn's replies). Every connection has its own input buffer and its own
  output queue; nobody waits on a slow client. Thousands of idle connections cost a file
  descriptor each (the server raises its RLIMIT_NOFILE soft limit to the hard limit at
  start).
* **Edge-triggered, in arrival order.** Connections are registered with EPOLLET, so the
  ready list holds them in the order their data arrived and requests of different clients
  run in that order, as torch's servers run them (level-triggered epoll re-queues every
  reported connection, and a newer request could overtake an older one). A readable
  connection is read until a short read (up to MAX_READS_PER_EVENT reads per turn).
* **A request is parsed where it arrived.** One handler per opcode, looked up by the first
  byte; a request that has not fully arrived is not looked at again until the bytes it
  needs are there, and a many-key request's end is found by a ``codec.ManyScan`` that reads
  each new length field once: a request of any size costs one pass.
* **Bad input closes that connection only**, with a log line that names the peer and the
  reason: an unknown opcode, a key over ``Limits.max_key`` or a value over
  ``Limits.max_value`` (checked as soon as the length field arrives), ADD on a non-numeric
  value, more than MAX_HELD_REQUESTS requests queued behind a wait. This is also how torch's
  servers report errors: the protocol has no error reply.
* **Backpressure, and one memory budget.** A connection whose replies the kernel did not
  take is not read again until they are sent (sending.py); one read's requests stop running
  once MAX_OUT_PARTS replies wait to go out. What the server allocates for its clients is
  counted against ``memory_budget`` (budget.py); past it, the connections holding the most
  are closed. A stored value that is overwritten while an unsent reply carries it lives on
  until that reply is out: backpressure bounds how many replies one connection can have
  waiting.
* **A batch path for the barrier's shape** (batch.py): a turn of at least
  ``batch.MIN_EVENTS`` plain ADD and one-key WAIT requests is read, recognised and run with
  C-level loops, and a turn with many replies (thousands of waiters released at once) is
  sent by helper threads too. Anything else, a single client's request included, goes
  through the general path.
* **Busy-poll after activity** (distlib/busy_poll.py). When a burst of requests ends, the
  loop keeps polling without sleeping for ``SPIN_S`` before it blocks: on VMs whose idle
  vCPUs halt, blocking costs ~100 us per request in wake-up latency, more than the request
  itself. It yields the CPU when it is wanted elsewhere (one usable CPU, more runnable
  tasks than CPUs); an idle server spins once and sleeps, so the cost is at most one window
  of CPU per burst.
* **Ordered waits** (codec.py): a request queued behind a pending WAIT or BARRIER on the
  same connection runs when that wait completes; CANCEL_WAIT runs at once. torch clients
  never notice; distlib clients use it to get a value in one round trip.

Limits: keys up to 8 KiB, values up to 8 MiB, 131072 keys per request by default (libuv's
numbers, so a request that works against torch's default server works here); change them
with ``distlib store-server --max-key-bytes/--max-value-bytes``.
"""

from __future__ import annotations

import collections
import logging
import os
import select
import socket
import threading
import time
from functools import partial
from typing import Deque, Dict, List, Optional

from ... import settings
from ...busy_poll import BusyPoll
from ...exposure import warn_open_listener
from ...net import bind_listener, bind_local_listener, raise_fd_limit, serves_loopback
from ...refusals import RefusalLog
from . import batch, codec
from .admission import Admission
from .budget import MEMORY_BUDGET, ClientLimits, MemoryBudget
from .codec import MANY_KEY_OPS, STOP_WAITING, U64, Limits, ManyScan, Op, ProtocolError
from .connection import EPOLLIN, EPOLLIN_ERRS, EPOLLOUT, EPOLLRDHUP, Connection
from .handlers import CloseConnection, Handlers
from .intake import Intake
from .security import StoreSecurity
from .sending import ReplySender
from .state import KeyValueState, StateError
from .tls_handshakes import TlsHandshakes

log = logging.getLogger("distlib.store.tcp.server")

#: One recv() per readable event. Not larger: CPython allocates the whole size for each call,
#: and a 256 KiB allocation costs more than the rest of a small request's handling.
RECV_SIZE = 64 * 1024
#: The most one recv() asks for while the rest of a large value is known to be on its way.
MAX_RECV_SIZE = 4 * 1024 * 1024
#: A connection's requests stop running for the turn once this many reply parts wait to go out
#: (a part is at most handlers.COPY_MAX bytes, or a stored value sent by reference).
MAX_OUT_PARTS = 64
#: Requests one connection may queue behind a pending WAIT (a distlib client queues one: its
#: GET; torch clients none).
MAX_HELD_REQUESTS = 64
#: After activity, poll without sleeping this long before blocking (busy_poll.py says when not).
SPIN_S = 200e-6

_STOP = bytes([STOP_WAITING])
_CANCEL_WAIT = int(Op.CANCEL_WAIT)
_WAIT = int(Op.WAIT)
#: What closes a connection: a malformed request, one the state refuses, a handler's verdict.
_CLOSING = (ProtocolError, StateError, CloseConnection)

#: recv() calls one readable event may make before the connection waits for the next turn.
MAX_READS_PER_EVENT = 16


class StoreServer(Intake, ReplySender, MemoryBudget):
    """The TCPStore server. ``serve_forever()`` in a thread or the main thread; ``stop()``.

    ``security``: the token and TLS every connection must go through; None reads them from
    the environment (``StoreSecurity.from_env``), so a process with ``DISTLIB_AUTH_TOKEN``
    never serves without it. ``StoreSecurity()`` is an open server. ``memory_budget`` and
    ``client_limits`` (budget.py) bound what its clients may make it hold.
    """

    def __init__(
        self,
        host: str = "",
        port: int = 0,
        listen_sock: Optional[socket.socket] = None,
        limits: Optional[Limits] = None,
        log_connections: bool = False,
        batch_path: bool = True,
        security: Optional[StoreSecurity] = None,
        memory_budget: int = MEMORY_BUDGET,
        client_limits: Optional[ClientLimits] = None,
    ):
        self.limits = limits or Limits()
        self.client_limits = client_limits or ClientLimits()
        self.security = security if security is not None else StoreSecurity.from_env()
        self.admission = Admission(self.security.token, self.security.server_tls)
        self.memory_budget = memory_budget
        self.buffered = 0  # what every connection holds (Connection.buffered), in bytes
        self.busy_poll = BusyPoll(SPIN_S)
        self.log_connections = log_connections
        self.listener = listen_sock if listen_sock is not None else bind_listener(host, port)
        self.listener.setblocking(False)
        self.port: int = self.listener.getsockname()[1]
        warn_open_listener("the store", self.listener, self.security.token)
        # Same-host distlib clients come in through this UNIX socket (client.py, "same-host
        # transport"): the same protocol, at a third of the kernel's cost per request.
        self.local_listener: Optional[socket.socket] = None
        if settings.store_unix_socket() and serves_loopback(self.listener):
            self.local_listener = bind_local_listener(self.port)
        self.state = KeyValueState(self._finish_wait, self.limits.max_value,
                                   self.client_limits.max_wait_keys_per_client, self.client_limits.max_wait_keys)
        self.conns: Dict[int, Connection] = {}
        self._admitting: Dict[int, Connection] = {}  # accepted, not admitted yet (admission.py)
        self._hosts: Dict[str, int] = {}  # peer address -> its admitted connections
        self._admitting_hosts: Dict[str, int] = {}  # peer address -> its connections on their way in
        #: Refusals and closes for what a client sent, logged once per address per interval.
        self.refusals = RefusalLog(log)
        #: With ``log_connections``: clients' connections and disconnections, the same way.
        self.connection_log = RefusalLog(log, noun="connections and disconnections")
        #: The TLS handshake thread (tls_handshakes.py), while serving with TLS.
        self.tls_handshakes: Optional[TlsHandshakes] = None
        self._admission_order: Deque[Connection] = collections.deque()  # by deadline
        self._dirty: List[Connection] = []  # connections with replies to send this turn
        self._resume: List[Connection] = []
        self._unread: List[Connection] = []
        self._listeners: Dict[int, socket.socket] = {}  # fd -> listening socket (serve_forever)
        self._due: Optional[float] = None  # the next admission deadline, accept resumption or refusal count
        self._accept_paused_until = 0.0
        self._emfile_log_at = 0.0
        self._emfile_unlogged = 0
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._stopping = False
        self._thread: Optional[threading.Thread] = None
        self._stopped = threading.Event()
        # The in-process master waits for its workers through this, not by polling.
        self.workers_joined = 0
        self.worker_peers: List[str] = []
        self.counter_changed = threading.Condition()
        self.handlers = Handlers(self.state, self.limits, self._worker_joined)
        # One entry per opcode byte: parse the request at buf[pos:end] and run it; return the
        # offset after it, or -need when it has not fully arrived (see _consume).
        self._ops = self.handlers.table()
        #: The batch path for plain ADD and WAIT turns (batch.py); ``batch_path=False`` leaves
        #: every request to the general path (the tests compare the two).
        self.batch: Optional[batch.BatchPath] = batch.BatchPath(self.state, self.limits) if batch_path else None

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self, name: str = "distlib-store-server") -> "StoreServer":
        """Serve on a daemon thread (the way TCPStore(is_master=True) runs it)."""
        self._thread = threading.Thread(target=self.serve_forever, name=name, daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Stop serving and close every connection; safe to call from any thread, twice."""
        self._stopping = True
        self._wake()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _wake(self) -> None:
        """Wake the loop (from another thread: stop(), the TLS handshake thread)."""
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass  # full (the loop will wake) or closed (stopped)

    @property
    def running(self) -> bool:
        return not self._stopped.is_set() and not self._stopping

    def serve_forever(self) -> None:
        raise_fd_limit()
        ep = select.epoll()
        self._listeners = {self.listener.fileno(): self.listener}
        if self.local_listener is not None:
            self._listeners[self.local_listener.fileno()] = self.local_listener
        for fd in self._listeners:
            ep.register(fd, EPOLLIN)
        ep.register(self._wake_r, EPOLLIN)
        if self.admission.tls_context is not None:
            self.tls_handshakes = TlsHandshakes(self.admission, self._wake, f"distlib-store-tls:{self.port}")
        poll = ep.poll
        probe = partial(poll, 0)
        spin = self.busy_poll.spin
        turn = self._turn
        clock = time.monotonic
        try:
            while not self._stopping:
                try:
                    events = poll(0)
                    if not events and not self._unread:
                        events = spin(probe) or poll(-1 if self._due is None else max(0.0, self._due - clock()))
                except InterruptedError:
                    continue
                turn(events, ep)
                if self._due is not None and clock() >= self._due:
                    self._timers(ep)
        finally:
            if self.tls_handshakes is not None:
                self.tls_handshakes.close()
            if self.batch is not None:
                self.batch.close()
            for conn in list(self.conns.values()) + list(self._admitting.values()):
                self._close(conn, ep, "server stopping", level=None)
            self.refusals.flush(final=True)
            self.connection_log.flush(final=True)
            ep.close()
            self.listener.close()
            if self.local_listener is not None:
                self.local_listener.close()
            os.close(self._wake_r)
            os.close(self._wake_w)
            self._stopped.set()
            with self.counter_changed:
                self.counter_changed.notify_all()

    def _turn(self, events, ep) -> None:
        """One loop turn: read and run what ``events`` report, then send every reply."""
        batch = self.batch
        if batch is not None and len(events) >= batch.min_events:
            conns = batch.take(events, self.conns)
            if conns is not None:
                self._batch_turn(conns, ep)
                events = ()
        conns = self.conns
        read_once = self._read_once
        for fd, ev in events:
            conn = conns.get(fd)
            if conn is None:
                self._on_other(fd, ev, ep)
                continue
            if ev & EPOLLOUT:
                self._flush_pending(conn, ep)
            if ev & EPOLLIN_ERRS and not conn.closed and read_once(conn, ep, ev):
                self._on_readable(conn, ep, ev)  # more than one read's worth (rare)
        while self._unread:  # connections with more to read than one turn allows, or resumed
            unread, self._unread = self._unread, []
            for conn in unread:
                if not conn.closed and not conn.paused:
                    self._continue(conn, ep)
        while self._resume:
            resume, self._resume = self._resume, []
            for conn in resume:
                if conn.closed:
                    continue
                try:
                    self._run_held(conn)
                except _CLOSING as exc:
                    self._close(conn, ep, str(exc))
        if self.buffered + self.state.wait_bytes > self.memory_budget:  # waits grew (budget.py)
            self._evict(ep)
        if self._dirty:
            self._flush(ep)

    def _batch_turn(self, conns: List[Connection], ep) -> None:
        """A turn the batch path took: it runs the frames it knows, in order; from the first
        one it does not, every connection goes through the general path, in order, with the
        bytes already received."""
        done, results = self.batch.run(conns, RECV_SIZE, self._dirty)
        for i in range(done, len(conns)):
            conn = conns[i]
            if conn.closed:
                continue
            result = results[i]
            if result is None:  # not read (the recv() of an earlier socket failed)
                more = self._read_once(conn, ep, EPOLLIN)
            elif result.__class__ is bytes:
                more = self._consume(conn, ep, EPOLLIN, result, RECV_SIZE)
            else:
                self._recv_failed(conn, ep, result)
                more = False
            if more:
                self._on_readable(conn, ep, EPOLLIN)

    def _on_other(self, fd: int, ev: int, ep) -> None:
        """An event on a connection being admitted, a listening socket (accept) or the wake-up
        pipe (drain it; take the connections whose TLS handshake is done)."""
        conn = self._admitting.get(fd)
        if conn is not None:
            self._advance(conn, ep, ev)
            return
        listener = self._listeners.get(fd)
        if listener is not None:
            self._accept(ep, listener, local=listener is self.local_listener)
        elif fd == self._wake_r:
            try:
                os.read(fd, 4096)
            except OSError:
                pass
            if self.tls_handshakes is not None:
                self._handshakes_done(ep)

    # -- reading and running ---------------------------------------------------------------------

    def _on_readable(self, conn: Connection, ep, ev: int) -> None:
        """Edge-triggered: read until the socket is drained (a short read; then one more
        read if the peer has closed, to see the EOF), running what arrives."""
        read = self._read_once
        for _ in range(MAX_READS_PER_EVENT):
            if not read(conn, ep, ev):
                return
        self._unread.append(conn)  # a busy client: the others get their turn first

    def _continue(self, conn: Connection, ep) -> None:
        """A connection listed in ``_unread``: run the requests it kept while its replies went
        out (backpressure), then read on."""
        if conn.gate is not None:
            self._advance(conn, ep, EPOLLIN)
            return
        inbuf = conn.inbuf
        if inbuf is not None and conn.need == 0:
            conn.inbuf = None
            self._charge(conn, -len(inbuf))
            data = bytes(inbuf)
            self._consume(conn, ep, 0, data, len(data) + 1)
            if conn.closed or conn.paused:
                return
        self._on_readable(conn, ep, EPOLLIN)

    def _read_once(self, conn: Connection, ep, ev: int) -> bool:
        """One recv(), run the requests it completes, send the replies. Returns whether the
        socket may hold more (a full read, or a pending EOF)."""
        size = RECV_SIZE
        inbuf = conn.inbuf
        if inbuf is not None:
            missing = conn.need - len(inbuf)
            if missing > size:  # the rest of a large value: read it in big steps
                size = min(missing, MAX_RECV_SIZE)
        try:
            data = conn.sock.recv(size)
        except OSError as exc:
            self._recv_failed(conn, ep, exc)
            return False
        return self._consume(conn, ep, ev, data, size)

    def _recv_failed(self, conn: Connection, ep, exc: OSError) -> None:
        if not isinstance(exc, (BlockingIOError, InterruptedError)):
            self._close(conn, ep, f"receive failed ({exc.strerror})")

    def _consume(self, conn: Connection, ep, ev: int, data: bytes, size: int) -> bool:
        """Run the requests that ``data`` (what one recv(size) returned) completes. Returns
        whether the socket may hold more (a full read, or a pending EOF)."""
        if not data:
            self._close(conn, ep, "disconnected")
            return False
        more = len(data) >= size or ev & EPOLLRDHUP
        if conn.inbuf is not None:
            data = self._complete(conn, ep, data)
            if data is None:
                return more and not conn.closed
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
            self._close(conn, ep, f"malformed request: {exc}")
            return False
        except (StateError, CloseConnection) as exc:
            self._close(conn, ep, str(exc))
            return False
        if conn.wait_count and self.buffered + self.state.wait_bytes > self.memory_budget:
            self._evict(ep)  # a wait grew the state past the budget (budget.py)
        if conn.closed:
            return False
        if consumed < end:
            more = self._keep(conn, ep, data, consumed) and more
        if conn.out:
            self._dirty.append(conn)  # sent at the end of the loop turn (_flush)
        return more

    def _complete(self, conn: Connection, ep, data: bytes) -> Optional[bytes]:
        """Add ``data`` to the request that has not fully arrived; the buffer once it has (the
        request first), else None."""
        inbuf = conn.inbuf
        inbuf += data
        self._charge(conn, len(data))
        if len(inbuf) < conn.need:
            self._check_budget(ep)
            return None
        scan = conn.scan
        if scan is not None:
            try:
                r = scan.advance(inbuf, len(inbuf))
            except ProtocolError as exc:
                self._close(conn, ep, f"malformed request: {exc}")
                return None
            if r < 0:
                conn.need = -r
                self._check_budget(ep)
                return None
            conn.scan = None
        conn.inbuf = None
        self._charge(conn, -len(inbuf))
        return bytes(inbuf)

    def _keep(self, conn: Connection, ep, data: bytes, consumed: int) -> bool:
        """Keep ``data[consumed:]``: a request that has not fully arrived, or requests that wait
        for the connection's replies to go out (``conn.paused``). Returns whether to read on."""
        rest = bytearray(memoryview(data)[consumed:])
        conn.inbuf = rest
        self._charge(conn, len(rest))
        if not conn.paused:
            conn.need -= consumed
            if rest[0] in MANY_KEY_OPS:  # its end is found by one pass over what arrives
                if rest[0] == _WAIT and len(rest) >= 9 and U64.unpack_from(rest, 1)[0] > self.state.max_wait_keys:
                    # over the cap: refused now, not after tens of megabytes of keys arrive
                    self._close(conn, ep, str(self.state.too_many_keys(U64.unpack_from(rest, 1)[0])))
                    return False
                conn.scan = ManyScan(rest[0], self.limits)
                try:
                    conn.need = -conn.scan.advance(rest, len(rest))
                except ProtocolError as exc:
                    self._close(conn, ep, f"malformed request: {exc}")
                    return False
        self._check_budget(ep)
        return not conn.paused and not conn.closed

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
            self._charge(conn, len(request))
        if not conn.wait_count:
            self._run_held(conn)
        return r

    def _run_held(self, conn: Connection) -> None:
        """Run the requests that queued behind a wait that has now completed, in order,
        until one of them waits again."""
        held = conn.held
        ops = self._ops
        while held and not conn.wait_count:
            request = held.popleft()
            self._charge(conn, -len(request))
            ops[request[0]](conn, request, 0, len(request))
        if not held:
            conn.held = None
        if conn.out:
            self._dirty.append(conn)

    # -- waits that complete, and the worker counter ---------------------------------------------

    def _finish_wait(self, conn: Connection) -> None:
        """The state released ``conn``'s wait: its STOP_WAITING goes out this turn, then the
        requests held behind the wait run."""
        conn.out.append(_STOP)
        self._dirty.append(conn)
        if conn.held:
            self._resume.append(conn)

    def _worker_joined(self, conn: Connection, value: int) -> None:
        if not conn.is_worker:
            conn.is_worker = True
            self.worker_peers.append(conn.peer)
        with self.counter_changed:
            self.workers_joined = value
            self.counter_changed.notify_all()

    def wait_for_workers(self, world_size: int, deadline) -> None:
        """Block until ``init/`` reaches ``world_size`` or the deadline passes (no polling)."""
        with self.counter_changed:
            while self.workers_joined < world_size and not self._stopped.is_set():
                left = deadline.remaining()
                if left <= 0:
                    break
                self.counter_changed.wait(left)

# -- standalone service -----------------------------------------------------------------------


def serve(host: str, port: int, limits: Optional[Limits] = None, security: Optional[StoreSecurity] = None,
          memory_budget: int = MEMORY_BUDGET, client_limits: Optional[ClientLimits] = None) -> int:
    """Run the TCP master service in this thread until SIGTERM/SIGINT; return an exit code."""
    import signal

    server = StoreServer(host, port, limits=limits, log_connections=True, security=security,
                         memory_budget=memory_budget, client_limits=client_limits)
    where = server.listener.getsockname()[0]
    caps = server.client_limits
    log.info("distlib store-server listening on %s (port %d%s); %s; key limit %d bytes, value limit %d bytes, "
             "memory budget %d bytes; at most %d connections, %d per address; a client waits for at most %d keys, "
             "all for at most %d", "every interface" if where in ("::", "0.0.0.0") else where, server.port,
             ", same-host socket too" if server.local_listener is not None else "",
             server.security.describe_server(), server.limits.max_key, server.limits.max_value, memory_budget,
             caps.max_connections, caps.max_connections_per_host, caps.max_wait_keys_per_client, caps.max_wait_keys)

    def on_signal(signum, _frame):
        log.info("received %s; shutting down", signal.Signals(signum).name)
        server.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    started = time.monotonic()
    server.serve_forever()
    log.info("store-server stopped after %.1f s", time.monotonic() - started)
    return 0
