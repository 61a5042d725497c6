"""``StoreServer``: the TCPStore server, one epoll loop, for torch and distlib clients alike.

Used in two ways: ``TCPStore(is_master=True)`` runs it on a daemon thread (as torch runs its
server thread), and ``distlib store-server`` runs it as the standalone TCP master service
that any number of jobs share.

This module is the event loop: it reads connections and hands the bytes to the request engine
(engine.py: framing, ordered waits, backpressure, with no sockets), which runs each request
through handlers.py (decode with codec.py, run on the state of state.py, queue the reply). The
loop composes the server's parts, each an object given what it uses: the engine (which owns
the state and the memory budget, budget.py), the intake (intake.py: accepting, admission.py's
steps, with TLS handshakes on tls_handshakes.py's thread, the limits on connections, closing),
the sending (sending.py) and the barrier's batch path (batch.py); a connection's fields are
connection.py. Design, and why:

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
  value, more than engine.MAX_HELD_REQUESTS requests queued behind a wait. This is also how
  torch's servers report errors: the protocol has no error reply.
* **Backpressure, and one memory budget.** A connection whose replies the kernel did not
  take is not read again until they are sent (sending.py); one read's requests stop running
  once engine.MAX_OUT_PARTS replies wait to go out. What the server allocates for its clients is
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
* **A state directory** (``state_dir``, ``distlib store-server --state-dir``; journal.py):
  the journal is replayed before the listening socket is bound (a client, or a TCP readiness
  probe, gets in only once the state is back), and each turn's changes are written (and with
  ``sync="turn"`` synced) with one write() after the turn ran and before its replies are
  sent. Without it, no journal object exists and the state is the plain one.
* **Ordered waits** (codec.py): a request queued behind a pending WAIT or BARRIER on the
  same connection runs when that wait completes; CANCEL_WAIT runs at once. torch clients
  never notice; distlib clients use it to get a value in one round trip.

Limits: keys up to 8 KiB, values up to 8 MiB, 131072 keys per request by default (libuv's
numbers, so a request that works against torch's default server works here); change them
with ``distlib store-server --max-key-bytes/--max-value-bytes``.
"""

from __future__ import annotations

import logging
import os
import select
import socket
import threading
import time
from functools import partial
from typing import List, Optional

from ... import settings
from ...busy_poll import BusyPoll
from ...exposure import warn_open_listener
from ...net import bind_listener, bind_local_listener, raise_fd_limit, serves_loopback
from . import batch
from .admission import Admission
from .budget import MEMORY_BUDGET, ClientLimits
from .codec import Limits
from .connection import EPOLLIN, EPOLLIN_ERRS, EPOLLOUT, EPOLLRDHUP, Connection
from .engine import RequestEngine
from .handlers import CloseConnection
from .intake import Intake
from .journal import COMPACT_BYTES, DEFAULT_SYNC, Journal, describe_sync
from .observe import Observer
from .security import StoreSecurity
from .sending import ReplySender

log = logging.getLogger("distlib.store.tcp.server")

#: One recv() per readable event. Not larger: CPython allocates the whole size for each call,
#: and a 256 KiB allocation costs more than the rest of a small request's handling.
RECV_SIZE = 64 * 1024
#: The most one recv() asks for while the rest of a large value is known to be on its way.
MAX_RECV_SIZE = 4 * 1024 * 1024
#: After activity, poll without sleeping this long before blocking (busy_poll.py says when not).
SPIN_S = 200e-6

#: recv() calls one readable event may make before the connection waits for the next turn.
MAX_READS_PER_EVENT = 16


class StoreServer:
    """The TCPStore server. ``serve_forever()`` in a thread or the main thread; ``stop()``.

    ``security``: the token and TLS every connection must go through; None reads them from
    the environment (``StoreSecurity.from_env``), so a process with ``DISTLIB_AUTH_TOKEN``
    never serves without it. ``StoreSecurity()`` is an open server. ``memory_budget`` and
    ``client_limits`` (budget.py) bound what its clients may make it hold. ``observer``
    (observe.py) is told of every request (the testing harness's master service). A server that
    is never served is ``close()``d.
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
        observer: Optional[Observer] = None,
        state_dir: Optional[str] = None,
        sync: str = DEFAULT_SYNC,
        compact_bytes: int = COMPACT_BYTES,
        lock_wait: float = 0.0,
    ):
        self.limits = limits or Limits()
        #: The state directory's journal (journal.py), replayed before the port is opened, so
        #: that a client (or a TCP readiness probe) gets in only once the state is back.
        self.journal: Optional[Journal] = None
        image = None
        if state_dir is not None:
            self.journal = Journal(state_dir, sync, compact_bytes, lock_wait)
            try:
                image = self.journal.recover()
            except BaseException:
                self.journal.close()
                raise
        self.client_limits = client_limits or ClientLimits()
        self.security = security if security is not None else StoreSecurity.from_env()
        self.admission = Admission(self.security.token, self.security.server_tls)
        self.memory_budget = memory_budget
        self.busy_poll = BusyPoll(SPIN_S)
        self.listener = listen_sock if listen_sock is not None else bind_listener(host, port)
        self.listener.setblocking(False)
        self.port: int = self.listener.getsockname()[1]
        warn_open_listener("the store", self.listener, self.security.token)
        # Same-host distlib clients come in through this UNIX socket (client.py, "same-host
        # transport"): the same protocol, at a third of the kernel's cost per request.
        self.local_listener: Optional[socket.socket] = None
        if settings.store_unix_socket() and serves_loopback(self.listener):
            self.local_listener = bind_local_listener(self.port)
        self.ep = select.epoll()
        self._unread: List[Connection] = []  # connections to read (on) before the turn ends
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._stopping = False
        #: Why the server stopped by itself (the journal could not be written), else None.
        self.failed: Optional[str] = None
        self._released = False  # the descriptors are closed (serve_forever's end, or close())
        self._thread: Optional[threading.Thread] = None
        self._stopped = threading.Event()
        # The in-process master waits for its workers through this, not by polling.
        self.workers_joined = 0
        self.worker_peers: List[str] = []
        self.counter_changed = threading.Condition()
        #: The requests: framing, ordered waits, the handlers, the state and the memory budget.
        self.engine = RequestEngine(self.limits, self.client_limits, memory_budget, self._worker_joined, observer,
                                    self.journal, image)
        batch_path = batch_path and observer is None  # an observer hears every request (observe.py)
        self.state = self.engine.state
        self.budget = self.engine.budget
        self._feed = self.engine.feed  # (once per read)
        #: Who comes in, and closing.
        self.intake = Intake(self.ep, self.listener, self.local_listener, self.admission, self.client_limits,
                             self.state, self.budget, self.engine.answered, self._admitted, log_connections)
        if self.journal is not None:
            self.intake.before_parting = self.journal.commit  # a closed connection's last replies too
        #: The batch path for plain ADD and WAIT turns (batch.py); ``batch_path=False`` leaves
        #: every request to the general path (the tests compare the two).
        self.batch: Optional[batch.BatchPath] = batch.BatchPath(self.state, self.limits) if batch_path else None
        self.sender = ReplySender(self.ep, self.budget, self.batch, self.intake.close, self._enforce_budget,
                                  self._read_later)

    @property
    def conns(self):
        """The admitted connections, by fd (the intake's table)."""
        return self.intake.conns

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

    def close(self) -> None:
        """Release what a server that was never served holds (its sockets, its epoll object);
        ``serve_forever`` does it when it ends. Closing twice does nothing."""
        if self._released:
            return
        for conn in list(self.intake.conns.values()) + list(self.intake.admitting.values()):
            self.intake.close(conn, "server closed", level=None)
        self.intake.close_listeners()
        self._release()

    def _release(self) -> None:
        self._released = True
        if self.journal is not None:
            self.journal.close()
        if self.batch is not None:
            self.batch.close()
        self.ep.close()
        os.close(self._wake_r)
        os.close(self._wake_w)

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
        ep = self.ep
        intake = self.intake
        intake.start(self._wake, f"distlib-store-tls:{self.port}")
        ep.register(self._wake_r, EPOLLIN)
        poll = ep.poll
        probe = partial(poll, 0)
        spin = self.busy_poll.spin
        turn = self.turn
        clock = time.monotonic
        try:
            while not self._stopping:
                try:
                    events = poll(0)
                    if not events and not self._unread:
                        due = intake.due
                        events = spin(probe) or poll(-1 if due is None else max(0.0, due - clock()))
                except InterruptedError:
                    continue
                turn(events)
                if intake.due is not None and clock() >= intake.due:
                    intake.timers()
        finally:
            intake.shutdown()
            self._release()
            self._stopped.set()
            with self.counter_changed:
                self.counter_changed.notify_all()

    def turn(self, events) -> None:
        """One loop turn: read and run what ``events`` (epoll's (fd, events) pairs) report, run
        what that released, then send every reply."""
        batch = self.batch
        if batch is not None and len(events) >= batch.min_events:
            taken = batch.take(events, self.intake.conns)  # type: ignore[arg-type]  # (duck-typed: batch.py)
            if taken is not None:
                self._batch_turn(taken)
                events = ()
        conns = self.intake.conns
        read_once = self._read
        for fd, ev in events:
            conn = conns.get(fd)
            if conn is None:
                self._on_other(fd, ev)
                continue
            if ev & EPOLLOUT:
                self.sender.flush_pending(conn)
            if ev & EPOLLIN_ERRS and not conn.closed and read_once(conn, ev):
                self._on_readable(conn, ev)  # more than one read's worth (rare)
        while self._unread:  # connections with more to read than one turn allows, or resumed
            unread, self._unread = self._unread, []
            for conn in unread:
                if not conn.closed and not conn.paused:
                    self._continue(conn)
        engine = self.engine
        while engine.released:  # waits that completed, with requests held behind them
            for conn in engine.take_released():
                if conn.closed:
                    continue
                try:
                    engine.run_held(conn)
                except CloseConnection as exc:
                    self.intake.close(conn, str(exc))
        budget = self.budget
        if budget.buffered + budget.state.wait_bytes > budget.limit:  # waits grew (budget.over, inline: per turn)
            self._evict()
        journal = self.journal
        if journal is not None and journal.pending:  # the turn's changes are on disk before its replies go
            try:
                journal.commit()
            except OSError as exc:
                self._journal_failed(exc)
                return
        if engine.answered:
            self.sender.flush(engine.answered)

    def _journal_failed(self, exc: OSError) -> None:
        """The journal could not be written (disk full, I/O error): no reply may go out for a
        change that is not on disk, so the server stops, answering nothing more, and exits 1;
        its supervisor restarts it and the clients reconnect and re-send (docs/stores.md)."""
        assert self.journal is not None, "only a server with a journal writes one"
        log.error("cannot write the journal in %s (%s): stopping without answering this turn's requests; the "
                  "state on disk is the last turn written", self.journal.directory, exc.strerror or exc)
        self.failed = f"journal write failed: {exc.strerror or exc}"
        self.intake.before_parting = None
        for conn in list(self.intake.conns.values()):
            conn.out = []  # (closing sends a connection's last replies: not these)
        self.engine.answered.clear()
        self._stopping = True

    def _batch_turn(self, conns: List[Connection]) -> None:
        """A turn the batch path took: it runs the frames it knows, in order; from the first
        one it does not, every connection goes through the general path, in order, with the
        bytes already received."""
        assert self.batch is not None, "a batch turn only with the batch path"
        done, results = self.batch.run(conns, RECV_SIZE, self.engine.answered)
        for i in range(done, len(conns)):
            conn = conns[i]
            if conn.closed:
                continue
            result = results[i]
            if result is None:  # not read (the recv() of an earlier socket failed)
                more = self._read(conn, EPOLLIN)
            elif result.__class__ is bytes:
                more = self._read(conn, EPOLLIN, result)
            else:
                self._recv_failed(conn, result)
                more = False
            if more:
                self._on_readable(conn, EPOLLIN)

    def _on_other(self, fd: int, ev: int) -> None:
        """An event on a connection being admitted, a listening socket (accept) or the wake-up
        pipe (drain it; take the connections whose TLS handshake is done)."""
        intake = self.intake
        conn = intake.admitting.get(fd)
        if conn is not None:
            if ev & EPOLLOUT and conn.pending is not None:
                self.sender.flush_pending(conn)
                if conn.closed:
                    return
            intake.advance(conn)
        elif fd in intake.listeners:
            intake.accept(fd)
        elif fd == self._wake_r:
            try:
                os.read(fd, 4096)
            except OSError:
                pass
            if intake.tls_handshakes is not None:
                intake.handshakes_done()

    def _admitted(self, conn: Connection, leftover: bytes) -> None:
        """The intake admitted ``conn``; ``leftover``: what followed its VALIDATE."""
        if leftover:
            self._read(conn, 0, leftover, len(leftover) + 1)
        if not conn.closed:
            self._unread.append(conn)  # edge-triggered: what followed VALIDATE is read now

    # -- reading ---------------------------------------------------------------------------------

    def _on_readable(self, conn: Connection, ev: int) -> None:
        """Edge-triggered: read until the socket is drained (a short read; then one more
        read if the peer has closed, to see the EOF), running what arrives."""
        read = self._read
        for _ in range(MAX_READS_PER_EVENT):
            if not read(conn, ev):
                return
        self._unread.append(conn)  # a busy client: the others get their turn first

    def _read_later(self, conn: Connection) -> None:
        """``conn`` may run and read again this turn (its replies went out: sending.py)."""
        self._unread.append(conn)

    def _continue(self, conn: Connection) -> None:
        """A connection listed in ``_unread``: take it on through admission, or run the
        requests it kept while its replies went out (backpressure), then read on."""
        if conn.gate is not None:
            self.intake.advance(conn)
            return
        try:
            go_on = self.engine.run_kept(conn)
        except CloseConnection as exc:
            self.intake.close(conn, str(exc))
            return
        if self.budget.over():
            self._evict()
        if go_on and not conn.closed:
            self._on_readable(conn, EPOLLIN)

    def _read(self, conn: Connection, ev: int, data: Optional[bytes] = None, size: int = RECV_SIZE) -> bool:
        """One recv() (or ``data``, what a recv(``size``) already returned), handed to the
        engine. Returns whether the socket may hold more (a full read, or a pending EOF) and
        the connection may read it."""
        if data is None:
            inbuf = conn.inbuf
            if inbuf is not None:
                missing = conn.need - len(inbuf)
                if missing > size:  # the rest of a large value: read it in big steps
                    size = min(missing, MAX_RECV_SIZE)
            try:
                data = conn.sock.recv(size)
            except OSError as exc:
                self._recv_failed(conn, exc)
                return False
        if not data:
            self.intake.close(conn, "disconnected")
            return False
        try:
            go_on = self._feed(conn, data)
        except CloseConnection as exc:
            self.intake.close(conn, str(exc))
            return False
        if conn.buffered or conn.wait_count:  # it holds something: over the budget? (budget.over, inline)
            budget = self.budget
            if budget.buffered + budget.state.wait_bytes > budget.limit:
                self._evict()
                if conn.closed:
                    return False
        return go_on and (len(data) >= size or ev & EPOLLRDHUP != 0)

    def _recv_failed(self, conn: Connection, exc: OSError) -> None:
        if not isinstance(exc, (BlockingIOError, InterruptedError)):
            self.intake.close(conn, f"receive failed ({exc.strerror})")

    # -- the memory budget -----------------------------------------------------------------------

    def _enforce_budget(self) -> None:
        if self.budget.over():
            self._evict()

    def _evict(self) -> None:
        """Over the budget: close the admitted connections holding the most (budget.py)."""
        self.budget.evict(list(self.intake.conns.values()), self.intake.close)

    # -- the worker counter ----------------------------------------------------------------------

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
          memory_budget: int = MEMORY_BUDGET, client_limits: Optional[ClientLimits] = None,
          state_dir: Optional[str] = None, sync: str = DEFAULT_SYNC, compact_bytes: int = COMPACT_BYTES,
          lock_wait: float = 0.0) -> int:
    """Run the TCP master service in this thread until SIGTERM/SIGINT; return an exit code."""
    import signal

    server = StoreServer(host, port, limits=limits, log_connections=True, security=security,
                         memory_budget=memory_budget, client_limits=client_limits, state_dir=state_dir,
                         sync=sync, compact_bytes=compact_bytes, lock_wait=lock_wait)
    if server.journal is not None:
        log.info("state directory %s: %s; compacted past %d MiB", server.journal.directory,
                 describe_sync(server.journal.sync), compact_bytes >> 20)
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
    log.info("store-server stopped after %.1f s%s", time.monotonic() - started,
             f" ({server.failed})" if server.failed else "")
    return 1 if server.failed else 0
