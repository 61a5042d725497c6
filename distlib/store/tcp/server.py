"""``StoreServer``: the TCPStore server, one epoll loop, for torch and distlib clients alike.

Used in two ways: ``TCPStore(is_master=True)`` runs it on a daemon thread (as torch runs its
server thread), and ``distlib store-server`` runs it as the standalone TCP master service
that any number of jobs share.

Design, and why:

* **One thread, non-blocking sockets, epoll** (the batch path below adds helper threads
  that only send a large turn's replies). Every connection has its own input buffer
  and its own output queue. A client that sends half a request and stalls, or never reads
  its replies, holds only its own buffers; nobody waits on it. Thousands of idle
  connections cost a file descriptor each (the server raises its RLIMIT_NOFILE soft limit
  to the hard limit at start).
* **Edge-triggered, in arrival order.** Connections are registered with EPOLLET, so the
  ready list holds them in the order their data arrived and requests of different clients
  run in that order, as torch's servers run them (level-triggered epoll re-queues every
  reported connection, and a newer request could overtake an older one). A readable
  connection is read until a short read (up to MAX_READS_PER_EVENT reads per turn).
* **One parse-and-run function per opcode** (``_op_*``, looked up in a 256-entry table):
  each decodes its request straight from the received bytes and runs it; a request that
  has not fully arrived returns how many bytes it needs, and is not looked at again until
  they are there (so a large value costs one pass, not one per packet). The layouts are
  protocol.py's; ``protocol.request_end`` sizes requests held behind a wait.
* **Bad input closes that connection only**, with a log line that names the peer and the
  reason: a first message that is not VALIDATE with the right magic, an unknown opcode, a
  key over ``Limits.max_key`` or a value over ``Limits.max_value`` (checked as soon as the
  length field arrives), ADD on a non-numeric value, or a client that lets more than
  ``MAX_PENDING_OUTPUT`` bytes of replies pile up unread. This is also how torch's servers
  report errors: the protocol has no error reply.
* **Replies go out at the end of the loop turn**, one send per connection, the replies a
  connection's own requests produced and the wake-ups other requests caused alike
  (``_flush`` says why).
* **A batch path for the barrier's shape** (batch.py). A turn of at least
  ``batch.MIN_EVENTS`` plain ADD and one-key WAIT requests is read, recognised and run with
  C-level loops and a cache of frames seen before, and a turn with many replies (thousands
  of waiters released at once) sends them through ``batch.send_replies``, split across
  helper threads: a send() on loopback or a LAN costs the sender the receiver's side of TCP
  too, so one thread's sends leave the other CPUs idle. Anything else, a single client's
  request included, goes through the general path; ``DISTLIB_STORE_BATCH=0`` turns the
  batch path off.
* **Busy-poll after activity** (BusyPoll). When a burst of requests ends, the loop keeps
  polling without sleeping for ``DISTLIB_STORE_SPIN_US`` (200 us) before it blocks. On VMs
  whose idle vCPUs halt (the anchors' machines), blocking costs ~100 us per request in wake-up
  latency, more than the request itself. It does not spin when it may use one CPU only, or
  while more tasks are runnable than it has CPUs (then spinning takes the CPU from a
  process with work to do); an idle server spins once and sleeps, so the cost is at most
  200 us of CPU per burst.
* **Same-host socket.** Listening on the wildcard address or on loopback, the server also
  listens on the abstract UNIX socket ``unix_socket_name(port)``; distlib clients that
  connect to a loopback address use it (client.py). Same protocol; the kernel's cost per
  request is about a third of TCP loopback's. ``DISTLIB_STORE_UNIX=0`` turns it off.
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
import struct
import sys
import threading
import time
from typing import Deque, Dict, List, Optional, Sequence

from ...cpus import usable_cpus
from ...errors import DistNetworkError
from ..base import INT64_MAX, INT64_MIN, parse_counter, wrap_int64
from . import batch, protocol
from .connect import lookup_name
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

#: One recv() per readable event. Not larger: CPython allocates the whole size for each call,
#: and a 256 KiB allocation costs more than the rest of a small request's handling.
RECV_SIZE = 64 * 1024
#: The most one recv() asks for while the rest of a large value is known to be on its way.
MAX_RECV_SIZE = 4 * 1024 * 1024
#: A turn with at least this many connections to answer sends through batch.send_replies.
FLUSH_BATCH_MIN = 16
MAX_PENDING_OUTPUT = 256 * 1024 * 1024  # unread replies past this close the connection
LISTEN_BACKLOG = 4096  # the kernel caps it at net.core.somaxconn
#: After activity, poll without sleeping this long before blocking (DISTLIB_STORE_SPIN_US;
#: see spin_seconds for the default).
DEFAULT_SPIN_US = 200.0

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
EPOLLIN_ERRS = EPOLLIN | EPOLL_ERRS
EPOLLRDHUP = getattr(select, "EPOLLRDHUP", 0x2000)
#: Connections are edge-triggered: the ready list then holds them in the order their data
#: arrived, and requests from different clients run in that order (level-triggered epoll
#: re-queues every reported fd behind the others, so a newer request could overtake an
#: older one; torch's servers keep arrival order, and code relies on it: a set() that has
#: returned is seen by a later request of another client).
CONN_EVENTS = EPOLLIN | EPOLLRDHUP | select.EPOLLET
#: recv() calls one readable event may make before the connection waits for the next turn.
MAX_READS_PER_EVENT = 16


class Connection:
    """Server-side state of one client connection.

    Kept small, because the loop touches it once per request: the queues that most
    connections never need (``pending``, ``held``, ``inbuf``) are None until they do.
    """

    __slots__ = (
        "sock", "fd", "peer", "inbuf", "need", "out", "pending", "pending_len",
        "validated", "wait_count", "wait_keys", "barrier_key", "held", "closed", "is_worker",
    )

    def __init__(self, sock: socket.socket, peer: str):
        self.sock = sock
        self.fd = sock.fileno()
        self.peer = peer
        self.inbuf: Optional[bytearray] = None  # the start of a request that has not fully arrived
        self.need = 0  # parse again once inbuf holds this many bytes
        self.out: List[bytes] = []  # replies produced this loop turn
        self.pending: Optional[Deque[bytes]] = None  # replies the kernel did not take yet
        self.pending_len = 0
        self.validated = False
        self.wait_count = 0  # > 0 while a WAIT or BARRIER is pending
        self.wait_keys: Sequence[bytes] = ()
        self.barrier_key: Optional[bytes] = None
        self.held: Optional[Deque[bytes]] = None  # raw requests queued behind a wait
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
            infos = socket.getaddrinfo(lookup_name(host), port, 0, socket.SOCK_STREAM, 0, socket.AI_PASSIVE)
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


def unix_socket_name(port: int) -> bytes:
    """The abstract UNIX socket a distlib server listening on TCP ``port`` (wildcard or
    loopback) also listens on, for distlib clients on the same host (see local_transport)."""
    return b"\0distlib-store/tcp-port/%d" % port


def local_transport_enabled() -> bool:
    """DISTLIB_STORE_UNIX=0 turns the same-host UNIX socket off, in servers and clients."""
    return os.environ.get("DISTLIB_STORE_UNIX", "1").strip().lower() not in ("0", "false", "no", "off")


def _serves_loopback(listener: socket.socket) -> bool:
    """Whether clients on this host reach ``listener`` through a loopback address."""
    try:
        address = listener.getsockname()[0]
    except OSError:
        return False
    if address.startswith("::ffff:"):
        address = address[7:]
    return address in ("", "0.0.0.0", "::") or address.startswith("127.") or address == "::1"


def bind_local_listener(port: int, backlog: int = LISTEN_BACKLOG) -> Optional[socket.socket]:
    """The abstract UNIX socket beside a TCP listener on ``port``, or None if it cannot be.

    Abstract names live in the network namespace, as loopback addresses do: exactly the
    processes that reach the server through 127.0.0.1 / ::1 can reach this socket, and it
    disappears with the last process that holds it (no file to clean up). A server creates
    it only when it listens on the wildcard address or on loopback, so no other server can
    own loopback:``port`` at the same time.
    """
    if not hasattr(socket, "AF_UNIX") or not sys.platform.startswith("linux"):
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(unix_socket_name(port))
        sock.listen(backlog)
    except OSError as exc:
        sock.close()
        log.debug("no same-host UNIX socket for port %d: %s", port, exc)
        return None
    sock.setblocking(False)
    return sock


def _unix_peer(sock: socket.socket) -> str:
    """A same-host client, for logs: loopback (the address it asked for stands for that),
    the transport, and its pid (SO_PEERCRED) when the kernel tells."""
    try:
        pid, _uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        return f"127.0.0.1:unix (pid {pid})"
    except (OSError, AttributeError, struct.error):
        return "127.0.0.1:unix"


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


def spin_seconds(env_name: str, default_us: float) -> float:
    """The busy-poll window from ``env_name`` (microseconds), else ``default_us``.

    Without the variable, a process that may run on one CPU only (``taskset -c 0``, a
    one-vCPU container) does not spin: the peer it waits for needs that CPU, so spinning
    could only delay the reply it is waiting for.
    """
    text = os.environ.get(env_name, "").strip()
    if text:
        return max(0.0, float(text)) / 1e6
    return default_us / 1e6 if usable_cpus() > 1 else 0.0


class BusyPoll:
    """Whether to busy-poll now: a spin window, and a check that no CPU is wanted elsewhere.

    Spinning pays when the peer runs on another, otherwise idle CPU; when more tasks are
    runnable than there are CPUs (many clients on few cores, other jobs on the machine),
    every microsecond spent spinning is taken from a process that has work to do — often
    the very peer being waited for. So each time it is about to spin, ``allowed()`` reads
    the number of runnable tasks at that moment (the 4th field of /proc/loadavg, about 2 us)
    and says no while it exceeds this process's CPUs.

    Read every time, not kept for a while: in a barrier of thousands of ranks the load
    changes faster than that. With the answer kept for up to 1 ms, the 4096-rank barrier of
    ``distlib bench store`` on 2 vCPUs was 1-8 % slower in each of 5 interleaved A/B runs
    (the server spun on a stale "not crowded" while the ranks' processes waited for a CPU).
    """

    _fd: Optional[int] = None  # /proc/loadavg, opened once per process

    def __init__(self, env_name: str, default_us: float):
        self.window = spin_seconds(env_name, default_us)
        self.cpus = usable_cpus()

    def allowed(self) -> bool:
        if not self.window:
            return False
        runnable = _runnable_tasks()
        return runnable is None or runnable <= self.cpus


def _runnable_tasks() -> Optional[int]:
    """Tasks runnable right now, machine-wide (this one included); None if unknown."""
    try:
        if BusyPoll._fd is None:
            BusyPoll._fd = os.open("/proc/loadavg", os.O_RDONLY | os.O_CLOEXEC)
        text = os.pread(BusyPoll._fd, 128, 0)
        return int(text.split()[3].split(b"/")[0])
    except (OSError, ValueError, IndexError):
        return None


_u64_from = U64.unpack_from
_u64_u64_from = struct.Struct("<QQ").unpack_from
_i64_from = I64.unpack_from
_u32_from = U32.unpack_from
_CANCEL_WAIT = int(Op.CANCEL_WAIT)


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
        self.busy_poll = BusyPoll("DISTLIB_STORE_SPIN_US", DEFAULT_SPIN_US)
        self.log_connections = log_connections
        self.listener = listen_sock if listen_sock is not None else bind_listener(host, port)
        self.listener.setblocking(False)
        self.port: int = self.listener.getsockname()[1]
        # Same-host distlib clients come in through this UNIX socket (client.py, "same-host
        # transport"): the same protocol, at a third of the kernel's cost per request.
        self.local_listener: Optional[socket.socket] = None
        if local_transport_enabled() and _serves_loopback(self.listener):
            self.local_listener = bind_local_listener(self.port)
        self.data: Dict[bytes, bytes] = {}
        self.queues: Dict[bytes, Deque[bytes]] = {}
        self.waiters: Dict[bytes, List[Connection]] = {}
        self.barrier_waiters: Dict[bytes, List[Connection]] = {}
        self.conns: Dict[int, Connection] = {}
        self._dirty: List[Connection] = []  # connections with replies to send this turn
        self._resume: List[Connection] = []
        self._unread: List[Connection] = []
        self._listeners: Dict[int, socket.socket] = {}  # fd -> listening socket (serve_forever)
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
        # One entry per opcode byte: parse the request at buf[pos:end] and run it; return the
        # offset after it, or -need when it has not fully arrived (see _process).
        ops = [self._op_unknown] * 256
        for op, fn in (
            (Op.VALIDATE, self._op_validate),
            (Op.SET, self._op_set),
            (Op.COMPARE_SET, self._op_compare_set),
            (Op.GET, self._op_get),
            (Op.ADD, self._op_add),
            (Op.CHECK, self._op_check),
            (Op.WAIT, self._op_wait),
            (Op.GETNUMKEYS, self._op_num_keys),
            (Op.DELETE_KEY, self._op_delete_key),
            (Op.APPEND, self._op_append),
            (Op.MULTI_GET, self._op_multi_get),
            (Op.MULTI_SET, self._op_multi_set),
            (Op.CANCEL_WAIT, self._op_cancel_wait),
            (Op.PING, self._op_ping),
            (Op.QUEUE_PUSH, self._op_queue_push),
            (Op.QUEUE_POP, self._op_queue_pop),
            (Op.QUEUE_LEN, self._op_queue_len),
            (Op.LIST_KEYS, self._op_list_keys),
            (Op.BARRIER, self._op_barrier),
        ):
            ops[op] = fn
        self._ops = ops
        #: The batch path for plain ADD and WAIT turns (batch.py); DISTLIB_STORE_BATCH=0 turns
        #: it off, leaving every request to the general path.
        self.batch: Optional[batch.BatchPath] = (
            None if os.environ.get("DISTLIB_STORE_BATCH", "1") == "0" else batch.BatchPath(self))

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
        self._listeners = {self.listener.fileno(): self.listener}
        if self.local_listener is not None:
            self._listeners[self.local_listener.fileno()] = self.local_listener
        for fd in self._listeners:
            ep.register(fd, EPOLLIN)
        ep.register(self._wake_r, EPOLLIN)
        poll = ep.poll
        turn = self._turn
        try:
            while not self._stopping:
                try:
                    events = poll(0)
                    if not events and not self._unread:
                        events = self._poll_spinning(ep)
                except InterruptedError:
                    continue
                turn(events, ep)
        finally:
            if self.batch is not None:
                self.batch.close()
            for conn in list(self.conns.values()):
                self._close(conn, ep, "server stopping", quiet=True)
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
        if batch is not None and len(events) >= batch.min_events and batch.run(events, ep, RECV_SIZE):
            events = ()
        conns = self.conns
        read_once = self._read_once
        for fd, ev in events:
            conn = conns.get(fd)
            if conn is None:
                self._on_listener(fd, ep)
                continue
            if ev & EPOLLOUT:
                self._flush_pending(conn, ep)
            if ev & EPOLLIN_ERRS and not conn.closed and read_once(conn, ep, ev):
                self._on_readable(conn, ep, ev)  # more than one read's worth (rare)
        if self._unread:  # connections that had more to read than one turn allows
            unread, self._unread = self._unread, []
            for conn in unread:
                if not conn.closed:
                    self._on_readable(conn, ep, EPOLLIN)
        while self._resume:
            resume, self._resume = self._resume, []
            for conn in resume:
                if conn.closed:
                    continue
                try:
                    self._run_held(conn)
                except (_CloseConnection, ProtocolError) as exc:
                    self._close(conn, ep, str(exc))
        if self._dirty:
            self._flush(ep)

    def _on_listener(self, fd: int, ep) -> None:
        """An event on a listening socket (accept) or on the wake-up pipe (drain it)."""
        listener = self._listeners.get(fd)
        if listener is not None:
            self._accept(ep, listener, local=listener is self.local_listener)
        elif fd == self._wake_r:
            try:
                os.read(fd, 4096)
            except OSError:
                pass

    def _poll_spinning(self, ep):
        """Wait for events: poll without sleeping for up to ``spin_s`` after the last activity,
        then block. See the module docstring ("busy-poll") for why."""
        poll = ep.poll
        busy = self.busy_poll
        if busy.allowed():
            clock = time.perf_counter
            spin_until = clock() + busy.window
            while clock() < spin_until:
                events = poll(0)
                if events:
                    return events
        return poll(-1)

    # -- connections -----------------------------------------------------------------------------

    def _accept(self, ep, listener: socket.socket, local: bool = False) -> None:
        while True:
            try:
                sock, addr = listener.accept()
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
            if local:
                peer = _unix_peer(sock)
            else:
                try:
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                except OSError:
                    pass
                peer = format_peer(addr)
            conn = Connection(sock, peer)
            self.conns[conn.fd] = conn
            ep.register(conn.fd, CONN_EVENTS)
            if self.log_connections:
                log.info("client %s connected (%d open)", conn.peer, len(self.conns))

    def _close(self, conn: Connection, ep, reason: str, quiet: bool = False) -> None:
        if conn.closed:
            return
        conn.closed = True
        conn.out = []  # nothing more to send (_flush skips it)
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

    def _on_readable(self, conn: Connection, ep, ev: int) -> None:
        """Edge-triggered: read until the socket is drained (a short read; then one more
        read if the peer has closed, to see the EOF), running what arrives."""
        read = self._read_once
        for _ in range(MAX_READS_PER_EVENT):
            if not read(conn, ep, ev):
                return
        self._unread.append(conn)  # a busy client: the others get their turn first

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
        more = len(data) == size or ev & EPOLLRDHUP
        inbuf = conn.inbuf
        if inbuf is not None:
            inbuf += data
            if len(inbuf) < conn.need:
                return more
            data = bytes(inbuf)
            conn.inbuf = None
        try:
            if conn.validated:  # _process's loop, inline (this runs once per request)
                ops = self._ops
                consumed, end = 0, len(data)
                while consumed < end:
                    if conn.wait_count or conn.held:
                        r = self._hold(conn, data, consumed, end)
                    else:
                        r = ops[data[consumed]](conn, data, consumed, end)
                    if r < 0:
                        conn.need = -r
                        break
                    consumed = r
            else:
                consumed = self._process(conn, data)
        except ProtocolError as exc:
            self._close(conn, ep, f"malformed request: {exc}")
            return False
        except _CloseConnection as exc:
            self._close(conn, ep, str(exc))
            return False
        if conn.closed:
            return False
        if consumed < len(data):
            conn.inbuf = bytearray(data[consumed:])
            conn.need -= consumed
        if conn.out:
            self._dirty.append(conn)  # sent at the end of the loop turn (_flush)
        return more

    def _process(self, conn: Connection, buf: bytes) -> int:
        """Run every complete request in ``buf``; return how many bytes were consumed.

        When ``buf`` ends inside a request, ``conn.need`` is set to the number of bytes (from
        the start of ``buf``) that must be there before that request is worth parsing again.
        """
        end = len(buf)
        pos = 0
        if not conn.validated:
            pos = self._first_message(conn, buf, end)
            if pos < 0:
                conn.need = -pos
                return 0
        ops = self._ops
        while pos < end:
            if conn.wait_count or conn.held:
                r = self._hold(conn, buf, pos, end)
            else:
                r = ops[buf[pos]](conn, buf, pos, end)
            if r < 0:
                conn.need = -r
                return pos
            pos = r
        return pos

    def _first_message(self, conn: Connection, buf: bytes, end: int) -> int:
        if buf[0] != Op.VALIDATE:
            raise _CloseConnection(
                f"first message must be VALIDATE with magic 0x{MAGIC:08x}, got opcode 0x{buf[0]:02x} "
                f"(not a TCPStore client? first bytes: {bytes(buf[:16])!r})")
        if end < 5:
            return -5
        magic = _u32_from(buf, 1)[0]
        if magic != MAGIC:
            raise _CloseConnection(f"first message must be VALIDATE with magic 0x{MAGIC:08x}, got magic 0x{magic:08x}")
        conn.validated = True
        return 5

    def _hold(self, conn: Connection, buf: bytes, pos: int, end: int) -> int:
        """Ordered waits: a request behind a pending wait queues up (as its raw bytes);
        CANCEL_WAIT ends the wait at once and lets the queued requests run, in order,
        before new ones."""
        if buf[pos] == _CANCEL_WAIT and conn.wait_count:
            self._cancel_wait(conn)
            r = pos + 1
        else:
            r = protocol.request_end(buf, pos, end, self.limits)
            if r < 0:
                return r
            if conn.held is None:
                conn.held = collections.deque()
            conn.held.append(buf[pos:r])
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
            ops[request[0]](conn, request, 0, len(request))
        if not held:
            conn.held = None
        if conn.out:
            self._dirty.append(conn)

    def _flush(self, ep) -> None:
        """Send every reply this loop turn produced, one send per connection.

        Replies go out at the end of the turn, not right after each read: a client process
        with many connections (a load generator, a proxy) then finds a burst of replies when
        it wakes, instead of being woken once per reply; measured on the 1024-rank barrier
        of ``distlib bench store``, this cut the server's CPU per round by about a quarter.
        A single client's request is the only event of its turn, so it waits for nothing.
        """
        dirty, self._dirty = self._dirty, []
        if self.batch is not None and len(dirty) >= FLUSH_BATCH_MIN:
            dirty = self._flush_batch(dirty)
        for conn in dirty:
            out = conn.out
            if not out:
                continue  # listed twice this turn, or closed
            if len(out) == 1 and conn.pending is None:  # the usual case: one reply, sent whole
                reply = out[0]
                try:
                    sent = conn.sock.send(reply)
                except OSError:
                    sent = 0  # _send tries again, and handles the full buffer or the error
                if sent == len(reply):
                    out.clear()
                    continue
                if sent:
                    out[0] = memoryview(reply)[sent:]
            self._send(conn, ep)

    def _flush_batch(self, dirty: List[Connection]) -> List[Connection]:
        """Send the single replies of a large turn with ``batch.send_replies``; return the
        connections left for ``_flush``'s general path (more than one reply, output already
        pending, or a send that did not take all)."""
        conns: List[Connection] = []
        replies: List[bytes] = []
        rest: List[Connection] = []
        for conn in dirty:
            out = conn.out
            if len(out) == 1 and conn.pending is None:
                conns.append(conn)
                replies.append(out.pop())
            elif out:  # (empty: listed twice this turn, or closed)
                rest.append(conn)
        batch.send_replies(self, conns, replies)
        if self._dirty:  # what send_replies gave back
            rest += self._dirty
            self._dirty = []
        return rest

    def _send(self, conn: Connection, ep) -> None:
        out = conn.out
        data = out[0] if len(out) == 1 else b"".join(out)
        conn.out = []
        if conn.pending is not None:
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
            conn.pending = collections.deque([memoryview(data)[sent:]])
            conn.pending_len = len(data) - sent
            if conn.pending_len > self.max_pending_output:
                self._close(conn, ep, f"client does not read its replies ({conn.pending_len} bytes unread)")
                return
            ep.modify(conn.fd, CONN_EVENTS | EPOLLOUT)

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
        conn.pending = None
        ep.modify(conn.fd, CONN_EVENTS)

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
        conn.wait_keys = ()
        conn.barrier_key = None
        conn.out.append(_STOP)
        self._dirty.append(conn)
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
        conn.wait_keys = ()
        conn.barrier_key = None
        conn.wait_count = 0

    # -- decoding helpers (each returns a negative ``-need`` when the bytes are not all there) ----

    def _blob(self, buf: bytes, p: int, end: int, cap: int, what: str):
        """(value, offset after it), or (None, -need)."""
        q = p + 8
        if q > end:
            return None, -q
        n = _u64_from(buf, p)[0]
        if n > cap:
            raise ProtocolError(f"{what} of {n} bytes exceeds the limit of {cap} bytes")
        r = q + n
        if r > end:
            return None, -r
        return buf[q:r], r

    def _keys(self, buf: bytes, p: int, end: int):
        """A u64 count and that many key blobs: (keys, offset after them), or (None, -need)."""
        q = p + 16
        if q <= end:
            count, n = _u64_u64_from(buf, p)
            if count == 1 and n <= self.limits.max_key:  # the usual case: one key
                r = q + n
                if r <= end:
                    return [buf[q:r]], r
        q = p + 8
        if q > end:
            return None, -q
        count = _u64_from(buf, p)[0]
        limits = self.limits
        if count > limits.max_keys:
            raise ProtocolError(f"request lists {count} keys, over the limit of {limits.max_keys}")
        cap = limits.max_key
        keys = []
        for _ in range(count):
            p = q + 8
            if p > end:
                return None, -p
            n = _u64_from(buf, q)[0]
            if n > cap:
                raise ProtocolError(f"key of {n} bytes exceeds the limit of {cap} bytes")
            q = p + n
            if q > end:
                return None, -q
            keys.append(buf[p:q])
        return keys, q

    def _key_value(self, buf: bytes, pos: int, end: int):
        """SET, APPEND, QUEUE_PUSH bodies: (key, value, offset after), or (None, None, -need)."""
        limits = self.limits
        key, p = self._blob(buf, pos + 1, end, limits.max_key, "key")
        if p < 0:
            return None, None, p
        value, p = self._blob(buf, p, end, limits.max_value, "value")
        return key, value, p

    # -- requests: parse and run -----------------------------------------------------------------

    def _op_unknown(self, conn: Connection, buf: bytes, pos: int, end: int) -> int:
        raise ProtocolError(f"unknown opcode 0x{buf[pos]:02x}")

    def _op_validate(self, conn: Connection, buf: bytes, pos: int, end: int) -> int:
        raise _CloseConnection("VALIDATE sent twice")

    def _op_set(self, conn: Connection, buf: bytes, pos: int, end: int) -> int:
        # the hot path, decoded inline: u8 op, u64 n, key, u64 m, value
        p = pos + 9
        if p > end:
            return -p
        n = _u64_from(buf, pos + 1)[0]
        limits = self.limits
        if n > limits.max_key:
            raise ProtocolError(f"key of {n} bytes exceeds the limit of {limits.max_key} bytes")
        q = p + n + 8
        if q > end:
            return -q
        m = _u64_from(buf, q - 8)[0]
        if m > limits.max_value:
            raise ProtocolError(f"value of {m} bytes exceeds the limit of {limits.max_value} bytes")
        r = q + m
        if r > end:
            return -r
        key = buf[p : p + n]
        self.data[key] = buf[q:r]
        if key in self.waiters:
            self._wake(key)
        return r

    def _op_get(self, conn: Connection, buf: bytes, pos: int, end: int) -> int:
        p = pos + 9
        if p > end:
            return -p
        n = _u64_from(buf, pos + 1)[0]
        if n > self.limits.max_key:
            raise ProtocolError(f"key of {n} bytes exceeds the limit of {self.limits.max_key} bytes")
        r = p + n
        if r > end:
            return -r
        value = self.data.get(buf[p:r])
        if value is None:
            conn.out.append(_EMPTY_BLOB)
        else:
            conn.out.append(_pack_u64(len(value)) + value)
        return r

    def _op_add(self, conn: Connection, buf: bytes, pos: int, end: int) -> int:
        p = pos + 9
        if p > end:
            return -p
        n = _u64_from(buf, pos + 1)[0]
        if n > self.limits.max_key:
            raise ProtocolError(f"key of {n} bytes exceeds the limit of {self.limits.max_key} bytes")
        q = p + n
        r = q + 8
        if r > end:
            return -r
        key = buf[p:q]
        data = self.data
        old = data.get(key)
        if old is not None and old.isdigit() and len(old) < 19:  # the usual case, inline
            value = int(old) + _i64_from(buf, q)[0]
            if value > INT64_MAX:
                value = wrap_int64(value)
            data[key] = b"%d" % value
            if key in self.waiters:
                self._wake(key)
        else:
            value = self._add_to(key, _i64_from(buf, q)[0], "ADD")
        conn.out.append(_pack_i64(value))
        if key == WORKER_COUNTER_KEY:
            self._worker_joined(conn, value)
        return r

    def _add_to(self, key: bytes, delta: int, what: str) -> int:
        """counter := stored value (strtoll rules; absent = 0) + delta, wrapped to int64 and
        stored as decimal ASCII; wakes waiters on the key. Returns the new value."""
        data = self.data
        old = data.get(key)
        if old is None:
            value = delta
        elif old.isdigit() and len(old) < 19:  # the usual case: a counter this server wrote
            value = int(old) + delta
        else:
            try:
                value = parse_counter(old, describe_key(key)) + delta
            except (ValueError, IndexError) as exc:
                raise _CloseConnection(f"{what} on key {describe_key(key)}: {exc}") from None
        if value > INT64_MAX or value < INT64_MIN:
            value = wrap_int64(value)
        self._store_counter(key, value)
        return value

    def _store_counter(self, key: bytes, value: int) -> None:
        """Store ``value`` (an int64) at ``key`` as decimal ASCII; wake waiters on the key."""
        self.data[key] = b"%d" % value
        if key in self.waiters:
            self._wake(key)

    def _worker_joined(self, conn: Connection, value: int) -> None:
        if not conn.is_worker:
            conn.is_worker = True
            self.worker_peers.append(conn.peer)
        with self.counter_changed:
            self.workers_joined = value
            self.counter_changed.notify_all()

    def _op_compare_set(self, conn: Connection, buf: bytes, pos: int, end: int) -> int:
        limits = self.limits
        key, p = self._blob(buf, pos + 1, end, limits.max_key, "key")
        if p < 0:
            return p
        expected, p = self._blob(buf, p, end, limits.max_value, "expected value")
        if p < 0:
            return p
        desired, p = self._blob(buf, p, end, limits.max_value, "desired value")
        if p < 0:
            return p
        current = self.data.get(key)
        if current is None:
            if expected:
                conn.out.append(_pack_u64(len(expected)) + expected)
                return p
        elif current != expected:
            conn.out.append(_pack_u64(len(current)) + current)
            return p
        self.data[key] = desired
        conn.out.append(_pack_u64(len(desired)) + desired)
        if key in self.waiters:
            self._wake(key)
        return p

    def _op_check(self, conn: Connection, buf: bytes, pos: int, end: int) -> int:
        keys, p = self._keys(buf, pos + 1, end)
        if p < 0:
            return p
        if len(keys) == 1 and keys[0] == ORDERED_WAIT_PROBE_KEY:
            conn.out.append(_READY)
            return p
        present = self._present
        conn.out.append(_READY if all(present(k) for k in keys) else _NOT_READY)
        return p

    def _op_wait(self, conn: Connection, buf: bytes, pos: int, end: int) -> int:
        keys, p = self._keys(buf, pos + 1, end)
        if p < 0:
            return p
        data = self.data
        queues = self.queues
        if len(keys) == 1:  # the usual case, without building a list
            key = keys[0]
            missing = [] if key in data or queues.get(key) else keys
        else:
            missing = [k for k in keys if k not in data and not queues.get(k)]
        if not missing:
            conn.out.append(_STOP)
            return p
        self._wait_for(conn, missing)
        return p

    def _wait_for(self, conn: Connection, missing: List[bytes]) -> None:
        """Register ``conn`` as waiting for every key of ``missing`` (none of them set yet)."""
        waiters = self.waiters
        for key in missing:
            lst = waiters.get(key)
            if lst is None:
                waiters[key] = [conn]
            else:
                lst.append(conn)
        conn.wait_keys = missing
        conn.wait_count = len(missing)

    def _op_num_keys(self, conn: Connection, buf: bytes, pos: int, end: int) -> int:
        conn.out.append(_pack_i64(len(self.data)))
        return pos + 1

    def _op_delete_key(self, conn: Connection, buf: bytes, pos: int, end: int) -> int:
        key, p = self._blob(buf, pos + 1, end, self.limits.max_key, "key")
        if p < 0:
            return p
        conn.out.append(_pack_i64(1 if self.data.pop(key, None) is not None else 0))
        return p

    def _op_append(self, conn: Connection, buf: bytes, pos: int, end: int) -> int:
        key, value, p = self._key_value(buf, pos, end)
        if p < 0:
            return p
        old = self.data.get(key)
        new = value if old is None else old + value
        if len(new) > self.limits.max_value:
            raise _CloseConnection(
                f"APPEND to key {describe_key(key)} would make a value of {len(new)} bytes, "
                f"over the limit of {self.limits.max_value}")
        self.data[key] = new
        if key in self.waiters:
            self._wake(key)
        return p

    def _op_multi_get(self, conn: Connection, buf: bytes, pos: int, end: int) -> int:
        keys, p = self._keys(buf, pos + 1, end)
        if p < 0:
            return p
        out = conn.out
        get = self.data.get
        for key in keys:
            value = get(key)
            if value is None:
                out.append(_EMPTY_BLOB)
            else:
                out.append(_pack_u64(len(value)))
                out.append(value)
        return p

    def _op_multi_set(self, conn: Connection, buf: bytes, pos: int, end: int) -> int:
        q = pos + 9
        if q > end:
            return -q
        count = _u64_from(buf, pos + 1)[0]
        limits = self.limits
        if count > limits.max_keys:
            raise ProtocolError(f"request lists {count} keys, over the limit of {limits.max_keys}")
        pairs = []
        blob = self._blob
        for _ in range(count):
            key, q = blob(buf, q, end, limits.max_key, "key")
            if q < 0:
                return q
            value, q = blob(buf, q, end, limits.max_value, "value")
            if q < 0:
                return q
            pairs.append((key, value))
        data = self.data
        waiters = self.waiters
        for key, value in pairs:
            data[key] = value
            if key in waiters:
                self._wake(key)
        return q

    def _op_cancel_wait(self, conn: Connection, buf: bytes, pos: int, end: int) -> int:
        self._cancel_wait(conn)
        return pos + 1

    def _cancel_wait(self, conn: Connection) -> None:
        self._drop_waits(conn)
        conn.out.append(_CANCELED)
        self._dirty.append(conn)

    def _op_ping(self, conn: Connection, buf: bytes, pos: int, end: int) -> int:
        r = pos + 5
        if r > end:
            return -r
        conn.out.append(buf[pos + 1 : r])
        return r

    def _op_queue_push(self, conn: Connection, buf: bytes, pos: int, end: int) -> int:
        key, value, p = self._key_value(buf, pos, end)
        if p < 0:
            return p
        self.queues.setdefault(key, collections.deque()).append(value)
        if key in self.waiters:
            self._wake_one(key)
        return p

    def _op_queue_pop(self, conn: Connection, buf: bytes, pos: int, end: int) -> int:
        key, p = self._blob(buf, pos + 1, end, self.limits.max_key, "key")
        if p < 0:
            return p
        queue = self.queues.get(key)
        if not queue:
            conn.out.append(_ZERO_I64)
            return p
        length = len(queue)
        value = queue.popleft()
        if not queue:
            del self.queues[key]
        conn.out.append(_pack_i64(length) + _pack_u64(len(value)) + value)
        return p

    def _op_queue_len(self, conn: Connection, buf: bytes, pos: int, end: int) -> int:
        key, p = self._blob(buf, pos + 1, end, self.limits.max_key, "key")
        if p < 0:
            return p
        conn.out.append(_pack_i64(len(self.queues.get(key, ()))))
        return p

    def _op_list_keys(self, conn: Connection, buf: bytes, pos: int, end: int) -> int:
        out = conn.out
        out.append(_pack_i64(len(self.data)))
        for key in self.data:
            out.append(_pack_u64(len(key)))
            out.append(key)
        return pos + 1

    def _op_barrier(self, conn: Connection, buf: bytes, pos: int, end: int) -> int:
        key, p = self._blob(buf, pos + 1, end, self.limits.max_key, "key")
        if p < 0:
            return p
        r = p + 8
        if r > end:
            return -r
        world_size = _i64_from(buf, p)[0]
        count = self._add_to(key, 1, "BARRIER")
        if count >= world_size:
            conn.out.append(_STOP)
            for other in self.barrier_waiters.pop(key, ()):
                if not other.closed and other.wait_count:
                    other.wait_count = 0
                    self._finish_wait(other)
            return r
        self.barrier_waiters.setdefault(key, []).append(conn)
        conn.barrier_key = key
        conn.wait_count = 1
        return r

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
