"""``StoreServer``: the TCPStore server, one epoll loop, for torch and distlib clients alike.

Used in two ways: ``TCPStore(is_master=True)`` runs it on a daemon thread (as torch runs its
server thread), and ``distlib store-server`` runs it as the standalone TCP master service
that any number of jobs share.

Design, and why:

* **One thread, non-blocking sockets, epoll.** Every connection has its own input buffer
  parsed incrementally (protocol.parse_request) and its own output queue. A client that
  sends half a request and stalls, or never reads its replies, holds only its own buffers;
  nobody waits on it. Thousands of idle connections cost a file descriptor each (the
  server raises its RLIMIT_NOFILE soft limit to the hard limit at start).
* **Bad input closes that connection only**, with a log line that names the peer and the
  reason: a first message that is not VALIDATE with the right magic, an unknown opcode, a
  key over ``Limits.max_key`` or a value over ``Limits.max_value`` (checked as soon as the
  length field arrives), ADD on a non-numeric value, or a client that lets more than
  ``MAX_PENDING_OUTPUT`` bytes of replies pile up unread. This is also how torch's servers
  report errors: the protocol has no error reply.
* **Replies are batched**: everything one read produced, and every wake-up it caused, goes
  out in one send per connection at the end of the loop turn.
* **Busy-poll after activity.** When a burst of requests ends, the loop keeps polling
  without sleeping for ``DISTLIB_STORE_SPIN_US`` (200 us) before it blocks. On VMs whose
  idle vCPUs halt (these machines), blocking costs ~100 us per request in wake-up latency,
  more than the request itself; an idle server spins once and then sleeps, so the cost is
  at most 200 us of CPU per burst.
* **Ordered waits** (protocol docstring): a request queued behind a pending WAIT or BARRIER
  on the same connection runs when that wait completes; CANCEL_WAIT runs at once. torch
  clients never notice; distlib clients use it to get a value in one round trip.

Where torch's two servers disagree or misbehave, this one takes the behaviour torch's
documentation promises (a key exists once set, a wait returns when its keys exist) and
stays acceptable to torch clients:

* COMPARE_SET wakes waiters when it writes the key, and only then (libuv also wakes on a
  compare_set that changed nothing, so a torch ``get`` can return ``b""`` for a key that was
  never set; legacy never wakes, so a waiter can miss a key that compare_set created).
* GET or MULTI_GET of a missing key answers an empty value and keeps the connection (as
  libuv; legacy closes it). No distlib or torch client asks before the key exists.
* A BARRIER increment that does not complete the barrier still wakes plain WAITs on the
  barrier's key (the key now exists), not the barrier's own participants.
* Queues (QUEUE_PUSH/POP/LEN) are served, as by torch's default libuv server.
* Zero-time waits are a client matter (the server only ever waits for keys).

Limits: keys up to 8 KiB, values up to 8 MiB, 131072 keys per request by default (libuv's
numbers, so a request that works against torch's default server works here); change them
with ``distlib store-server --max-key-bytes/--max-value-bytes``.
"""

from __future__ import annotations

import collections
import errno
import logging
import os
import resource
import select
import socket
import threading
import time
from typing import Deque, Dict, List, Optional, Set, Tuple

from ...errors import DistNetworkError
from ..base import parse_counter, wrap_int64
from . import protocol
from .protocol import (
    I64,
    MAGIC,
    NOT_READY,
    ORDERED_WAIT_PROBE_KEY,
    READY,
    STOP_WAITING,
    U32,
    U64,
    WAIT_CANCELED,
    WORKER_COUNTER_KEY,
    Limits,
    Op,
    ProtocolError,
    describe_key,
)

log = logging.getLogger("distlib.store.tcp.server")

RECV_SIZE = 256 * 1024
MAX_PENDING_OUTPUT = 256 * 1024 * 1024  # unread replies past this close the connection
LISTEN_BACKLOG = 4096  # the kernel caps it at net.core.somaxconn
#: After activity, poll without sleeping this long before blocking (DISTLIB_STORE_SPIN_US).
SPIN_S = float(os.environ.get("DISTLIB_STORE_SPIN_US", "200")) / 1e6

_STOP = bytes([STOP_WAITING])
_CANCELED = bytes([WAIT_CANCELED])
_READY = bytes([READY])
_NOT_READY = bytes([NOT_READY])
_EMPTY_BLOB = U64.pack(0)
_ZERO_I64 = I64.pack(0)
_pack_u64 = U64.pack
_pack_i64 = I64.pack

EPOLLIN = select.EPOLLIN
EPOLLOUT = select.EPOLLOUT
EPOLL_ERRS = select.EPOLLHUP | select.EPOLLERR


class Connection:
    """Server-side state of one client connection."""

    __slots__ = (
        "sock", "fd", "peer", "inbuf", "out", "pending", "pending_len", "validated",
        "wait_count", "wait_keys", "barrier_key", "held", "closed", "is_worker",
    )

    def __init__(self, sock: socket.socket, peer: str):
        self.sock = sock
        self.fd = sock.fileno()
        self.peer = peer
        self.inbuf = bytearray()
        self.out: List[bytes] = []  # replies produced this loop turn
        self.pending: Deque[bytes] = collections.deque()  # replies the kernel did not take yet
        self.pending_len = 0
        self.validated = False
        self.wait_count = 0  # > 0 while a WAIT or BARRIER is pending
        self.wait_keys: List[bytes] = []
        self.barrier_key: Optional[bytes] = None
        self.held: Deque[Tuple[int, tuple]] = collections.deque()  # requests behind a wait
        self.closed = False
        self.is_worker = False  # sent ADD "init/"


def format_peer(addr) -> str:
    host, port = addr[0], addr[1]
    if host.startswith("::ffff:"):
        host = host[7:]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def bind_listener(host: str, port: int, backlog: int = LISTEN_BACKLOG) -> socket.socket:
    """Bind and listen on every interface: an IPv6 dual-stack socket, else IPv4.

    Like torch, the ``host`` argument names where clients find the server; the server
    itself listens on all interfaces (``host`` "" or "0.0.0.0" or "::" for the wildcard, or
    a specific address to restrict it). Raises DistNetworkError with torch's text when the
    port is taken.
    """
    errors = []
    wildcard = host in ("", "0.0.0.0", "::", "*")
    attempts = [(socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")] if wildcard else []
    if not wildcard:
        try:
            infos = socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM, 0, socket.AI_PASSIVE)
            attempts = [(info[0], info[4][0]) for info in infos]
        except socket.gaierror as exc:
            raise DistNetworkError(f"The server socket cannot bind: host {host!r} does not resolve ({exc})") from exc
    for family, addr in attempts:
        sock = None
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            sock.bind((addr, port))
            sock.listen(backlog)
            return sock
        except OSError as exc:
            if sock is not None:
                sock.close()
            errors.append(f"bind to {format_peer((addr, port))} failed (errno {exc.errno}: {exc.strerror})")
            if exc.errno == errno.EAFNOSUPPORT:
                continue
    raise DistNetworkError(
        "The server socket has failed to listen on any local network address. "
        f"port: {port}: " + "; ".join(errors)
        + (" — another process (or an earlier run) is using this port; pick another port or stop it"
           if any("errno 98" in e for e in errors) else "")
    )


def raise_fd_limit() -> int:
    """Raise RLIMIT_NOFILE's soft limit to the hard limit; return the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        hard = 1 << 20
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return soft


class StoreServer:
    """The TCPStore server. ``serve_forever()`` in a thread or the main thread; ``stop()``."""

    def __init__(
        self,
        host: str = "",
        port: int = 0,
        listen_sock: Optional[socket.socket] = None,
        limits: Optional[Limits] = None,
        log_connections: bool = False,
    ):
        self.limits = limits or Limits()
        self.max_pending_output = MAX_PENDING_OUTPUT
        self.spin_s = SPIN_S
        self.log_connections = log_connections
        self.listener = listen_sock if listen_sock is not None else bind_listener(host, port)
        self.listener.setblocking(False)
        self.port: int = self.listener.getsockname()[1]
        self.data: Dict[bytes, bytes] = {}
        self.queues: Dict[bytes, Deque[bytes]] = {}
        self.waiters: Dict[bytes, List[Connection]] = {}
        self.barrier_waiters: Dict[bytes, List[Connection]] = {}
        self.conns: Dict[int, Connection] = {}
        self._dirty: Set[Connection] = set()
        self._resume: List[Connection] = []
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
        self._handlers = {
            Op.SET: self._set,
            Op.COMPARE_SET: self._compare_set,
            Op.GET: self._get,
            Op.ADD: self._add,
            Op.CHECK: self._check,
            Op.WAIT: self._wait,
            Op.GETNUMKEYS: self._num_keys,
            Op.DELETE_KEY: self._delete_key,
            Op.APPEND: self._append,
            Op.MULTI_GET: self._multi_get,
            Op.MULTI_SET: self._multi_set,
            Op.CANCEL_WAIT: self._cancel_wait,
            Op.PING: self._ping,
            Op.QUEUE_PUSH: self._queue_push,
            Op.QUEUE_POP: self._queue_pop,
            Op.QUEUE_LEN: self._queue_len,
            Op.LIST_KEYS: self._list_keys,
            Op.BARRIER: self._barrier,
        }

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self, name: str = "distlib-store-server") -> "StoreServer":
        """Serve on a daemon thread (the way TCPStore(is_master=True) runs it)."""
        self._thread = threading.Thread(target=self.serve_forever, name=name, daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Stop serving and close every connection; safe to call from any thread, twice."""
        self._stopping = True
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    @property
    def running(self) -> bool:
        return not self._stopped.is_set() and not self._stopping

    def serve_forever(self) -> None:
        raise_fd_limit()
        ep = select.epoll()
        ep.register(self.listener.fileno(), EPOLLIN)
        ep.register(self._wake_r, EPOLLIN)
        listen_fd = self.listener.fileno()
        conns = self.conns
        try:
            while not self._stopping:
                try:
                    events = ep.poll(0)
                    if not events and not self._resume:
                        events = self._poll_spinning(ep)
                except InterruptedError:
                    continue
                for fd, ev in events:
                    if fd == listen_fd:
                        self._accept(ep)
                        continue
                    if fd == self._wake_r:
                        try:
                            os.read(self._wake_r, 4096)
                        except OSError:
                            pass
                        continue
                    conn = conns.get(fd)
                    if conn is None:
                        continue
                    if ev & EPOLLOUT:
                        self._flush_pending(conn, ep)
                    if ev & (EPOLLIN | EPOLL_ERRS):
                        self._on_readable(conn, ep)
                while self._resume:
                    resume, self._resume = self._resume, []
                    for conn in resume:
                        if conn.closed:
                            continue
                        try:
                            self._run_held(conn)
                        except _CloseConnection as exc:
                            self._close(conn, ep, str(exc))
                if self._dirty:
                    dirty, self._dirty = self._dirty, set()
                    for conn in dirty:
                        if conn.out and not conn.closed:
                            self._send(conn, ep)
        finally:
            for conn in list(conns.values()):
                self._close(conn, ep, "server stopping", quiet=True)
            ep.close()
            self.listener.close()
            os.close(self._wake_r)
            os.close(self._wake_w)
            self._stopped.set()
            with self.counter_changed:
                self.counter_changed.notify_all()

    def _poll_spinning(self, ep):
        """Wait for events: poll without sleeping for up to ``spin_s`` after the last activity,
        then block. See the module docstring ("busy-poll") for why."""
        spin_until = time.perf_counter() + self.spin_s
        poll = ep.poll
        while True:
            events = poll(0)
            if events:
                return events
            if time.perf_counter() >= spin_until:
                return poll(-1)

    # -- connections -----------------------------------------------------------------------------

    def _accept(self, ep) -> None:
        while True:
            try:
                sock, addr = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE):
                    log.error("cannot accept a connection: out of file descriptors (%d open)", len(self.conns))
                    return
                if exc.errno in (errno.ECONNABORTED, errno.EPROTO):
                    continue
                raise
            sock.setblocking(False)
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass
            conn = Connection(sock, format_peer(addr))
            self.conns[conn.fd] = conn
            ep.register(conn.fd, EPOLLIN)
            if self.log_connections:
                log.info("client %s connected (%d open)", conn.peer, len(self.conns))

    def _close(self, conn: Connection, ep, reason: str, quiet: bool = False) -> None:
        if conn.closed:
            return
        conn.closed = True
        self._drop_waits(conn)
        self.conns.pop(conn.fd, None)
        try:
            ep.unregister(conn.fd)
        except (OSError, ValueError):
            pass
        if not quiet:  # log first: the log line should exist by the time the client sees EOF
            if reason == "disconnected":
                if self.log_connections:
                    log.info("client %s disconnected (%d open)", conn.peer, len(self.conns))
            else:
                log.warning("closed connection of client %s: %s (%d open)", conn.peer, reason, len(self.conns))
        conn.sock.close()

    def _on_readable(self, conn: Connection, ep) -> None:
        try:
            data = conn.sock.recv(RECV_SIZE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._close(conn, ep, f"receive failed ({exc.strerror})")
            return
        if not data:
            self._close(conn, ep, "disconnected")
            return
        if conn.inbuf:
            conn.inbuf += data
            buf = conn.inbuf
        else:
            buf = data
        try:
            consumed = self._process(conn, buf)
        except ProtocolError as exc:
            self._close(conn, ep, f"malformed request: {exc}")
            return
        except _CloseConnection as exc:
            self._close(conn, ep, str(exc))
            return
        if conn.closed:
            return
        if buf is conn.inbuf:
            del conn.inbuf[:consumed]
        elif consumed < len(data):
            conn.inbuf = bytearray(data[consumed:])
        if conn.out:
            self._send(conn, ep)

    def _process(self, conn: Connection, buf) -> int:
        """Run every complete request in ``buf``; return how many bytes were consumed."""
        pos, end = 0, len(buf)
        limits = self.limits
        parse = protocol.parse_request
        handlers = self._handlers
        if not conn.validated and buf[0] != Op.VALIDATE:
            raise _CloseConnection(
                f"first message must be VALIDATE with magic 0x{MAGIC:08x}, got opcode 0x{buf[0]:02x} "
                f"(not a TCPStore client? first bytes: {bytes(buf[:16])!r})")
        while pos < end:
            parsed = parse(buf, pos, end, limits)
            if parsed is None:
                break
            op, args, pos = parsed
            if not conn.validated:
                if op != Op.VALIDATE or args[0] != MAGIC:
                    what = f"opcode 0x{op:02x}" if op != Op.VALIDATE else f"magic 0x{args[0]:08x}"
                    raise _CloseConnection(f"first message must be VALIDATE with magic 0x{MAGIC:08x}, got {what}")
                conn.validated = True
                continue
            if conn.wait_count or conn.held:
                # Ordered waits: requests behind a pending wait queue up; CANCEL_WAIT ends the
                # wait at once and lets the queued requests run, in order, before new ones.
                if op == Op.CANCEL_WAIT and conn.wait_count:
                    self._cancel_wait(conn)
                else:
                    conn.held.append((op, args))
                if not conn.wait_count:
                    self._run_held(conn)
                continue
            if op == Op.VALIDATE:
                raise _CloseConnection("VALIDATE sent twice")
            handlers[op](conn, *args)
        return pos

    def _run_held(self, conn: Connection) -> None:
        """Run the requests that queued behind a wait that has now completed, in order,
        until one of them waits again."""
        held = conn.held
        handlers = self._handlers
        while held and not conn.wait_count:
            op, args = held.popleft()
            if op == Op.VALIDATE:
                raise _CloseConnection("VALIDATE sent twice")
            handlers[op](conn, *args)
        if conn.out:
            self._dirty.add(conn)

    def _send(self, conn: Connection, ep) -> None:
        out = conn.out
        data = out[0] if len(out) == 1 else b"".join(out)
        conn.out = []
        if conn.pending:
            conn.pending.append(data)
            conn.pending_len += len(data)
            if conn.pending_len > self.max_pending_output:
                self._close(conn, ep, f"client does not read its replies ({conn.pending_len} bytes unread)")
            return
        try:
            sent = conn.sock.send(data)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError as exc:
            self._close(conn, ep, "disconnected" if exc.errno in (errno.EPIPE, errno.ECONNRESET) else f"send failed ({exc.strerror})")
            return
        if sent < len(data):
            conn.pending.append(memoryview(data)[sent:])
            conn.pending_len = len(data) - sent
            if conn.pending_len > self.max_pending_output:
                self._close(conn, ep, f"client does not read its replies ({conn.pending_len} bytes unread)")
                return
            ep.modify(conn.fd, EPOLLIN | EPOLLOUT)

    def _flush_pending(self, conn: Connection, ep) -> None:
        pending = conn.pending
        while pending:
            head = pending[0]
            try:
                sent = conn.sock.send(head)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                self._close(conn, ep, "disconnected" if exc.errno in (errno.EPIPE, errno.ECONNRESET) else f"send failed ({exc.strerror})")
                return
            conn.pending_len -= sent
            if sent < len(head):
                pending[0] = memoryview(head)[sent:]
                return
            pending.popleft()
        ep.modify(conn.fd, EPOLLIN)

    # -- waiting ---------------------------------------------------------------------------------

    def _present(self, key: bytes) -> bool:
        return key in self.data or bool(self.queues.get(key))

    def _wake(self, key: bytes) -> None:
        """Key ``key`` now exists: complete the waits that were missing only it."""
        waiting = self.waiters.pop(key, None)
        if not waiting:
            return
        for conn in waiting:
            if conn.closed or not conn.wait_count:
                continue
            conn.wait_count -= 1
            if conn.wait_count == 0:
                self._finish_wait(conn)

    def _wake_one(self, key: bytes) -> None:
        """QUEUE_PUSH: complete the first wait that this push satisfies (torch's rule)."""
        waiting = self.waiters.get(key)
        while waiting:
            conn = waiting.pop(0)
            if conn.closed or not conn.wait_count:
                continue
            conn.wait_count -= 1
            if conn.wait_count == 0:
                self._finish_wait(conn)
                break
        if not waiting:
            self.waiters.pop(key, None)

    def _finish_wait(self, conn: Connection) -> None:
        conn.wait_keys = []
        conn.barrier_key = None
        conn.out.append(_STOP)
        self._dirty.add(conn)
        if conn.held:
            self._resume.append(conn)

    def _drop_waits(self, conn: Connection) -> None:
        for key in conn.wait_keys:
            lst = self.waiters.get(key)
            if lst is not None:
                try:
                    lst.remove(conn)
                except ValueError:
                    pass
                if not lst:
                    del self.waiters[key]
        if conn.barrier_key is not None:
            lst = self.barrier_waiters.get(conn.barrier_key)
            if lst is not None:
                try:
                    lst.remove(conn)
                except ValueError:
                    pass
                if not lst:
                    del self.barrier_waiters[conn.barrier_key]
        conn.wait_keys = []
        conn.barrier_key = None
        conn.wait_count = 0

    # -- request handlers ------------------------------------------------------------------------

    def _set(self, conn: Connection, key: bytes, value: bytes) -> None:
        self.data[key] = value
        if key in self.waiters:
            self._wake(key)

    def _get(self, conn: Connection, key: bytes) -> None:
        value = self.data.get(key)
        if value is None:
            conn.out.append(_EMPTY_BLOB)
        else:
            conn.out.append(_pack_u64(len(value)))
            conn.out.append(value)

    def _add(self, conn: Connection, key: bytes, delta: int) -> None:
        old = self.data.get(key)
        try:
            value = wrap_int64((parse_counter(old, describe_key(key)) if old is not None else 0) + delta)
        except (ValueError, IndexError) as exc:
            raise _CloseConnection(f"ADD on key {describe_key(key)}: {exc}") from None
        self.data[key] = str(value).encode()
        conn.out.append(_pack_i64(value))
        if key in self.waiters:
            self._wake(key)
        if key == WORKER_COUNTER_KEY:
            self._worker_joined(conn, value)

    def _worker_joined(self, conn: Connection, value: int) -> None:
        if not conn.is_worker:
            conn.is_worker = True
            self.worker_peers.append(conn.peer)
        with self.counter_changed:
            self.workers_joined = value
            self.counter_changed.notify_all()

    def _compare_set(self, conn: Connection, key: bytes, expected: bytes, desired: bytes) -> None:
        current = self.data.get(key)
        if current is None:
            if expected:
                conn.out.append(_pack_u64(len(expected)) + expected)
                return
        elif current != expected:
            conn.out.append(_pack_u64(len(current)) + current)
            return
        self.data[key] = desired
        conn.out.append(_pack_u64(len(desired)) + desired)
        if key in self.waiters:
            self._wake(key)

    def _check(self, conn: Connection, keys: List[bytes]) -> None:
        if len(keys) == 1 and keys[0] == ORDERED_WAIT_PROBE_KEY:
            conn.out.append(_READY)
            return
        present = self._present
        conn.out.append(_READY if all(present(k) for k in keys) else _NOT_READY)

    def _wait(self, conn: Connection, keys: List[bytes]) -> None:
        present = self._present
        missing = [k for k in keys if not present(k)]
        if not missing:
            conn.out.append(_STOP)
            return
        for key in missing:
            self.waiters.setdefault(key, []).append(conn)
        conn.wait_keys = missing
        conn.wait_count = len(missing)

    def _num_keys(self, conn: Connection) -> None:
        conn.out.append(_pack_i64(len(self.data)))

    def _delete_key(self, conn: Connection, key: bytes) -> None:
        conn.out.append(_pack_i64(1 if self.data.pop(key, None) is not None else 0))

    def _append(self, conn: Connection, key: bytes, value: bytes) -> None:
        old = self.data.get(key)
        new = value if old is None else old + value
        if len(new) > self.limits.max_value:
            raise _CloseConnection(
                f"APPEND to key {describe_key(key)} would make a value of {len(new)} bytes, "
                f"over the limit of {self.limits.max_value}")
        self.data[key] = new
        if key in self.waiters:
            self._wake(key)

    def _multi_get(self, conn: Connection, keys: List[bytes]) -> None:
        out = conn.out
        get = self.data.get
        for key in keys:
            value = get(key)
            if value is None:
                out.append(_EMPTY_BLOB)
            else:
                out.append(_pack_u64(len(value)))
                out.append(value)

    def _multi_set(self, conn: Connection, pairs: List[Tuple[bytes, bytes]]) -> None:
        for key, value in pairs:
            self.data[key] = value
            if key in self.waiters:
                self._wake(key)

    def _cancel_wait(self, conn: Connection) -> None:
        self._drop_waits(conn)
        conn.out.append(_CANCELED)
        self._dirty.add(conn)

    def _ping(self, conn: Connection, nonce: int) -> None:
        conn.out.append(U32.pack(nonce))

    def _queue_push(self, conn: Connection, key: bytes, value: bytes) -> None:
        self.queues.setdefault(key, collections.deque()).append(value)
        if key in self.waiters:
            self._wake_one(key)

    def _queue_pop(self, conn: Connection, key: bytes) -> None:
        queue = self.queues.get(key)
        if not queue:
            conn.out.append(_ZERO_I64)
            return
        length = len(queue)
        value = queue.popleft()
        if not queue:
            del self.queues[key]
        conn.out.append(_pack_i64(length) + _pack_u64(len(value)) + value)

    def _queue_len(self, conn: Connection, key: bytes) -> None:
        conn.out.append(_pack_i64(len(self.queues.get(key, ()))))

    def _list_keys(self, conn: Connection) -> None:
        out = conn.out
        out.append(_pack_i64(len(self.data)))
        for key in self.data:
            out.append(_pack_u64(len(key)))
            out.append(key)

    def _barrier(self, conn: Connection, key: bytes, world_size: int) -> None:
        old = self.data.get(key)
        try:
            count = wrap_int64((parse_counter(old, describe_key(key)) if old is not None else 0) + 1)
        except (ValueError, IndexError) as exc:
            raise _CloseConnection(f"BARRIER on key {describe_key(key)}: {exc}") from None
        self.data[key] = str(count).encode()
        if key in self.waiters:
            self._wake(key)
        if count >= world_size:
            conn.out.append(_STOP)
            for other in self.barrier_waiters.pop(key, ()):
                if not other.closed and other.wait_count:
                    other.wait_count = 0
                    self._finish_wait(other)
            return
        self.barrier_waiters.setdefault(key, []).append(conn)
        conn.barrier_key = key
        conn.wait_count = 1

    # -- for the in-process master ---------------------------------------------------------------

    def wait_for_workers(self, world_size: int, deadline) -> None:
        """Block until ``init/`` reaches ``world_size`` or the deadline passes (no polling)."""
        with self.counter_changed:
            while self.workers_joined < world_size and not self._stopped.is_set():
                left = deadline.remaining()
                if left <= 0:
                    break
                self.counter_changed.wait(left)


class _CloseConnection(Exception):
    """Raised by a handler: close this client's connection, with this reason in the log."""


# -- standalone service -----------------------------------------------------------------------


def serve(host: str, port: int, limits: Optional[Limits] = None) -> int:
    """Run the TCP master service in this thread until SIGTERM/SIGINT; return an exit code."""
    import signal

    server = StoreServer(host, port, limits=limits, log_connections=True)
    log.info("distlib store-server listening on %s (port %d); key limit %d bytes, value limit %d bytes",
             host or "*", server.port, server.limits.max_key, server.limits.max_value)

    def on_signal(signum, _frame):
        log.info("received %s; shutting down", signal.Signals(signum).name)
        server.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    started = time.monotonic()
    server.serve_forever()
    log.info("store-server stopped after %.1f s", time.monotonic() - started)
    return 0
