"""``Mesh``: one TCP connection between every pair of ranks of a group, and how bytes move on it.

Establishing: every rank listens, publishes ``host:port`` (and its host identity) in the
group's store, waits for everyone's, connects to every lower rank and accepts every higher
one; a HELLO frame names the connecting rank and the group, so a stray connection is refused.
With a job token (auth.py) every connection first runs the challenge-response, the acceptor
speaking first: a peer that cannot prove the token is refused before one byte of it is read
as a frame (object collectives unpickle what peers send), logged once per address, and the
mesh goes on waiting for the real peer.

Moving bytes (frames.py for the layout):

* **Sends** are done by the calling thread, header and payload in one ``sendmsg`` of
  memoryviews (no copy), on non-blocking sockets polled against the operation's deadline.
* **Receives are posted** (a buffer and what is expected) and matched to incoming frames:
  DATA by ``(seq, step)``, P2P first-in-first-out per (peer, tag). A frame whose receive
  is already posted is read straight into that buffer (``recv_into``, no copy); one that
  arrives early is kept until its receive is posted (matching.py holds those tables).
* **Who reads:** the thread waiting for a frame reads the connection itself when no other
  thread is reading it (one wake-up, not two: a hand-off between threads costs ~100 µs on
  these VMs). A progress thread reads every other connection that has data, so a peer's
  send never blocks because this rank is busy elsewhere (no send/send deadlock, whatever
  order isend/irecv are issued in), and a peer that dies is noticed at once.
* **Who is to blame:** a rank blocked in a wait sends a HEARTBEAT every few seconds saying
  what it waits for. When a wait times out, the error says whether the awaited rank is alive
  (and waiting on whom) and which ranks have gone silent — in a ring every rank waits on a
  neighbour, so naming only the awaited one would usually blame an innocent rank.
* **Failure:** a peer that closes its connection, a frame that does not match what this rank
  expects, or a deadline that passes aborts the mesh: an ABORT frame with the reason goes to
  every peer, every pending and later operation raises ``DistBackendError`` with that reason
  (naming the rank and its host:port), and nothing waits past its deadline. A group whose
  mesh aborted is unusable; destroy it and init again.
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import os
import select
import socket
import struct
import threading
import time
from functools import partial
from typing import Dict, List, Optional, Sequence, Tuple, Union

from .. import auth
from ..busy_poll import BusyPoll
from ..deadline import Deadline, format_duration
from ..errors import DistBackendError, DistNetworkError
from ..exposure import warn_open_listener
from ..net import classify, tune
from ..refusals import RefusalLog
from ..net import format_endpoint as endpoint
from . import frames
from .accept import Handshakes
from .early import EarlyBuffers
from .frames import ABORT, DATA, HEARTBEAT, HELLO, P2P
from .matching import LOST, Matching, Slot

log = logging.getLogger("distlib.transport.tcp")

ANY_SOURCE = -1
SLICE = 0.5  # seconds one blocking socket call may take before deadlines are checked again
#: A rank blocked in a wait tells its peers what it waits for this often; a peer not heard
#: from for SILENT_AFTER seconds while others wait is reported as the likely culprit.
HEARTBEAT_INTERVAL = 2.0
#: How long a waiting reader polls before it blocks (busy_poll.py, backing off in time; 0
#: turns it off).
SPIN_S = 80e-6
SILENT_AFTER = 3 * HEARTBEAT_INTERVAL
#: After a wait for a frame of at least this many bytes the connection goes back to the
#: progress thread at once (rearm_due): in a large transfer it receives the next piece while
#: this thread sends one (64 MiB all_reduce over TCP, 2 ranks: half the bandwidth without).
EAGER_REARM_BYTES = 256 << 10
#: SO_RCVBUF of a connection between two ranks on one machine when that machine runs more of
#: the group's ranks than it has CPUs. See crowded_receive_buffer.
CROWDED_RCVBUF = 2048 << 10
#: How long an accepted connection has for each step of its handshake (the answer to the
#: token's challenge, its HELLO). A real peer answers in one round trip; connections are
#: handled side by side (accept.py), so a silent one holds up nobody but itself.
AUTH_REPLY_S = 5.0
_POLLIN = select.POLLIN | select.POLLPRI
_EPOLLIN_ONCE = select.EPOLLIN | select.EPOLLONESHOT


def crowded_receive_buffer(ranks_here: int, cpus: int) -> int:
    """SO_RCVBUF for connections between ranks on this machine (0: the kernel's autotuning).

    Why: with more ranks than CPUs, the rank that is running sends ahead into the buffer
    of a neighbour that is not, and the kernel's autotuning lets that buffer grow to
    tcp_rmem's maximum (32 MiB here) per connection. Every queued byte is a kernel page that
    is written, waits, and is read back cold. A fixed 2 MiB (the kernel allocates twice
    that) keeps the in-flight data small: a 64 MiB all_reduce over TCP with 4 ranks on 2
    CPUs took 178 instead of 210 ms (median of 8 interleaved rounds), and 3 ranks 103
    instead of 125 ms. With a CPU per rank the cap only makes senders wait (2 ranks on 2
    CPUs: 80 instead of 63 ms), so it is not set then, nor for peers on other machines,
    where the buffer must cover the network's bandwidth-delay product.
    """
    return CROWDED_RCVBUF if ranks_here > cpus else 0


def _open_connection(host: str, port: int, timeout: float) -> socket.socket:
    """A TCP connection to ``host:port``. Peers advertise IP addresses, which need no name
    lookup: connecting directly skips getaddrinfo, whose first call in a process imports the
    IDNA codec (about 1 ms of CPU in every rank at init, all ranks at once)."""
    try:
        family = socket.AF_INET6 if ipaddress.ip_address(host.split("%")[0]).version == 6 else socket.AF_INET
    except ValueError:
        return socket.create_connection((host, port), timeout=timeout)
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        sock.connect((host, port))
    except BaseException:
        sock.close()
        raise
    return sock


class BlockedSend:
    """A send that waits for the peer to read (its TCP window is closed): listed among the
    waits a heartbeat reports, as receives are."""

    __slots__ = ("conn", "what")
    sending = True

    def __init__(self, conn: "PeerConnection", what: str):
        self.conn = conn
        self.what = what


class PeerConnection:
    """The connection to one peer; frames are read by whoever holds ``read_lock``."""

    def __init__(self, peer: int, sock: socket.socket, address: str):
        self.peer = peer
        self.sock = sock
        self.fd = sock.fileno()
        self.address = address
        self.send_lock = threading.Lock()
        self.read_lock = threading.Lock()
        self.failed: Optional[DistBackendError] = None
        self.header = bytearray(frames.HEADER_SIZE)
        self.last_heard = time.monotonic()
        self.status = ""  # what the peer said it waits for (HEARTBEAT)
        self.status_time = 0.0
        self.leftover = b""  # the unsent tail of a heartbeat: goes out before any other frame
        self.poller = select.poll()
        self.poller.register(self.fd, _POLLIN)

    def name(self) -> str:
        return f"rank {self.peer} ({self.address})"


class Mesh:
    """The connections of one process group (or of one interface of it)."""

    def __init__(self, rank: int, size: int, timeout_s: float, mesh_id: int, label: str,
                 token: Optional[bytes] = None):
        self.rank = rank
        #: The job's token: every connection is authenticated with it (None: not at all).
        self.token = token
        #: Connections refused, by address: logged once per interval with a count (refusals.py);
        #: their totals go into the timeout error
        self.refused = RefusalLog(log)
        self.size = size
        self.timeout_s = timeout_s
        self.mesh_id = mesh_id
        self.label = label
        self.conns: List[Optional[PeerConnection]] = [None] * size
        self.by_fd: Dict[int, PeerConnection] = {}
        #: Posted receives and the frames that came before theirs (matching.py)
        self.matching = Matching(size, self._name_of)
        self.early = EarlyBuffers()  # frames that arrive before their receive is posted
        self.error: Optional[DistBackendError] = None
        self.closed = False
        self.listener: Optional[socket.socket] = None
        # what threads are blocked on (receives, and sends the peer does not read): for heartbeats
        self.waits: Dict[int, Tuple[Union[Slot, BlockedSend], float]] = {}
        # connections a waiting thread has read and not re-armed (see rearm_due)
        self._due: set = set()
        self._last_beat = 0.0
        # Not yielding to runnable tasks: peers are often on other hosts, and the back-off
        # covers a host with more ranks than cores.
        self._busy_poll = BusyPoll(SPIN_S, yield_cpu=False, backoff=True)
        self._epoll = select.epoll()
        self._wake_r, self._wake_w = os.pipe()
        self._epoll.register(self._wake_r, select.EPOLLIN)
        self._progress: Optional[threading.Thread] = None
        #: Called (no arguments) when the mesh fails, a peer's connection is lost, or the mesh
        #: closes: waiters outside the mesh (shared memory) sleep on something else, and must
        #: be woken to look at the news.
        self.trouble_hooks: List = []

    # -- establishing ----------------------------------------------------------------------------

    def connect_all(self, addresses: Sequence[Tuple[str, int]], deadline: Deadline,
                    rcvbuf: Sequence[int] = ()) -> None:
        """Connect to every lower rank, accept every higher one, start the progress thread.
        ``rcvbuf[peer]``, where given and > 0, fixes that connection's SO_RCVBUF."""
        warn_open_listener("this rank's gloo mesh", self.listener, self.token)  # once per process (exposure.py)
        hello = frames.pack(HELLO, 0, 0, 0, 0, 0, 0, frames.HELLO_PAYLOAD.size) + \
            frames.HELLO_PAYLOAD.pack(self.rank, self.mesh_id)
        for peer in range(self.rank):
            host, port = addresses[peer]
            sock = self._connect(peer, host, port, deadline)
            if self.token is not None:
                self._authenticate_to(peer, sock, host, port, deadline)
            sock.sendall(hello)
            self._add(peer, sock, endpoint(host, port), rcvbuf[peer] if peer < len(rcvbuf) else 0)
        expected = set(range(self.rank + 1, self.size))
        if expected:
            handshakes = Handshakes(self.listener, self.size, self.mesh_id, self.token, AUTH_REPLY_S,
                                    self._refused_connection, self._log_dropped)
            for peer, sock in handshakes.run(expected, deadline):
                expected.discard(peer)
                self._add(peer, sock, endpoint(addresses[peer][0], addresses[peer][1]),
                          rcvbuf[peer] if peer < len(rcvbuf) else 0)
        self.refused.flush(final=True)  # the counts of refusals not logged yet: accepting is over
        if expected:
            for conn in self.conns:
                if conn is not None:
                    conn.sock.close()
            missing = ", ".join(f"{r} ({endpoint(*addresses[r][:2])})" for r in sorted(expected))
            raise DistNetworkError(
                f"{self.label}: rank {self.rank} waited {format_duration(deadline.seconds)} for ranks {missing} "
                f"to connect to {endpoint(*self.listener.getsockname()[:2])}; they published their addresses "
                f"but never connected (their host went down or the process died after joining, a firewall, "
                f"or this rank's advertised address is unreachable from them: set GLOO_SOCKET_IFNAME)"
                f"{self._refusals_text()}")
        self._progress = threading.Thread(target=self._progress_loop, name=f"distlib-progress-{self.label}",
                                          daemon=True)
        self._progress.start()

    def _connect(self, peer: int, host: str, port: int, deadline: Deadline) -> socket.socket:
        delay = 0.01
        last = "no attempt"
        while True:
            try:
                sock = _open_connection(host, port, max(0.01, min(5.0, deadline.remaining())))
                tune(sock)
                sock.settimeout(None)
                return sock
            except OSError as exc:
                last = classify(exc)
            if deadline.expired():
                raise DistNetworkError(
                    f"{self.label}: rank {self.rank} could not connect to rank {peer} at {endpoint(host, port)} "
                    f"within {format_duration(deadline.seconds)}: {last}. The address is the one rank {peer} "
                    f"advertised; if it is unreachable from here set GLOO_SOCKET_IFNAME on rank {peer}, "
                    f"and check firewalls (DISTLIB_PORT_RANGE confines the ports)")
            time.sleep(min(delay, deadline.remaining()))
            delay = min(0.5, delay * 2)

    def _authenticate_to(self, peer: int, sock: socket.socket, host: str, port: int, deadline: Deadline) -> None:
        """Prove the token to rank ``peer``'s listener, and make it prove it back."""
        where = f"rank {peer} at {endpoint(host, port)}"
        try:
            auth.connect_blocking(sock, self.token, deadline, where)
        except (auth.AuthError, OSError) as exc:
            sock.close()
            detail = str(exc) if isinstance(exc, auth.AuthError) else classify(exc)
            raise auth.AuthError(
                f"{self.label}: rank {self.rank} could not authenticate its mesh connection to {where}: {detail}. "
                f"Every rank of the job must have the same DISTLIB_AUTH_TOKEN (or DISTLIB_AUTH_TOKEN_FILE)") from None

    def _refused_connection(self, host: str, where: str, reason: str) -> None:
        """A connection failed authentication: logged once per address per interval, with a
        count (distlib/refusals.py), and remembered for the timeout error."""
        self.refused.refused(host, f"{self.label}: rank {self.rank} refused a mesh connection from {where}: {reason} "
                                   f"(this job's mesh requires authentication with DISTLIB_AUTH_TOKEN; nothing it sent "
                                   f"was read)", reason)

    def _log_dropped(self, message: str, *args) -> None:
        log.debug("%s: rank %d " + message, self.label, self.rank, *args)

    def _refusals_text(self) -> str:
        summary = self.refused.summary()
        return "; meanwhile it refused connections that failed authentication: " + summary if summary else ""

    def _add(self, peer: int, sock: socket.socket, address: str, rcvbuf: int = 0) -> None:
        # Blocking sockets with kernel timeouts: one recv_into(MSG_WAITALL) reads a whole
        # payload and one sendmsg sends a whole frame (no poll-and-retry per chunk), while
        # every call still returns within SLICE to check the deadline and the mesh state.
        sock.setblocking(True)
        if rcvbuf > 0:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        timeval = struct.pack("ll", int(SLICE), int((SLICE % 1) * 1e6))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
        conn = PeerConnection(peer, sock, address)
        self.conns[peer] = conn
        self.by_fd[conn.fd] = conn
        self._epoll.register(conn.fd, _EPOLLIN_ONCE)

    # -- sending ---------------------------------------------------------------------------------

    def send(self, peer: int, header: bytes, payload: memoryview, deadline: Deadline, what: str) -> None:
        """Send one frame to ``peer`` (header + payload, no copy of the payload)."""
        conn = self._conn(peer, what)
        with conn.send_lock:
            self._check(conn)
            sock = conn.sock
            pending = [memoryview(header)]
            if conn.leftover:
                pending.insert(0, memoryview(conn.leftover))
                conn.leftover = b""
            if payload.nbytes:
                pending.append(payload.cast("B") if payload.format != "B" else payload)
            blocked_key = None
            try:
                while pending:
                    try:
                        sent = sock.sendmsg(pending)
                    except (BlockingIOError, InterruptedError):
                        sent = 0  # a SLICE passed with the peer's window closed
                    except OSError as exc:
                        raise self._send_failed(conn, what, exc) from None
                    while sent and pending:
                        head = pending[0]
                        if sent >= head.nbytes:
                            sent -= head.nbytes
                            pending.pop(0)
                        else:
                            pending[0] = head[sent:]
                            sent = 0
                    if pending:
                        if self.error is not None:
                            raise self.error
                        if deadline.expired():
                            raise self._timeout(conn, f"sending {what} (the peer is not reading)", deadline)
                        if blocked_key is None:
                            # The peer's window is closed: this thread now waits on it, and
                            # the heartbeats must say so, or the ranks waiting on this one
                            # would count it as silent and blame it.
                            blocked = BlockedSend(conn, what)
                            blocked_key = id(blocked)
                            self.waits[blocked_key] = (blocked, time.monotonic())
                            self.rearm_due()  # the peer may be blocked sending to this rank
                        self._heartbeat()
            finally:
                if blocked_key is not None:
                    self.waits.pop(blocked_key, None)

    def _send_failed(self, conn: PeerConnection, what: str, exc: Optional[OSError]) -> DistBackendError:
        error = self._peer_lost(conn, f"sending {what}", exc)
        self.abort(error)
        return error

    # -- receiving -------------------------------------------------------------------------------

    def begin(self, seq: int, op: int, dtype: int, redop: int, count: int) -> None:
        """This rank starts collective ``seq`` on this mesh (Matching.begin): a frame that
        arrived before this call and contradicts it aborts the group now."""
        if self.error is not None:
            raise self.error  # the cause, not the frames its abort left unread
        stale = self.matching.begin(seq, op, dtype, redop, count)
        if stale:
            error = DistBackendError(f"{self.label}: {stale}")
            self.abort(error)
            raise error

    def _name_of(self, peer: int) -> str:
        conn = self.conns[peer]
        return conn.name() if conn is not None else f"rank {peer}"

    def post_data(self, peer: int, seq: int, step: int, view: memoryview, op: int, dtype: int, redop: int,
                  count: int, what: str) -> Slot:
        """Post the receive of a collective's frame ``(seq, step)`` from ``peer``."""
        conn = self._conn(peer, what)
        slot = Slot(view, DATA, op, dtype, redop, count, what, seq)
        slot.conn = conn
        kept = self.matching.post_data(peer, seq, step, slot)
        if kept is None:
            return slot
        if kept is LOST:
            self._check(conn)
        self._fill_from_early(conn, slot, *kept)
        return slot

    def post_p2p(self, peer: int, tag: int, view: memoryview, dtype: int, count: int, what: str) -> Slot:
        """Post a point-to-point receive from ``peer`` (or ANY_SOURCE) with ``tag``."""
        slot = Slot(view, P2P, frames.OPS["send"], dtype, 0, count, what)
        if self.error is not None:
            raise self.error
        self.rearm_due()  # the progress thread fills it if nobody waits (irecv + is_completed)
        if peer != ANY_SOURCE:
            slot.conn = self._conn(peer, what)
        found = self.matching.post_p2p(None if peer == ANY_SOURCE else peer, tag, slot)
        if found is None:
            return slot
        if found is LOST:
            self._check(slot.conn)
        source, kept = found
        self._fill_from_early(self.conns[source], slot, *kept)
        return slot

    def _fill_from_early(self, conn: PeerConnection, slot: Slot, header: tuple, data: bytearray) -> None:
        kind, op, dtype, redop, seq, step, count, nbytes = header
        problem = slot.mismatch(op, dtype, redop, nbytes, count, conn.name())
        if problem:
            self._mismatch(slot, problem)
            raise slot.error
        if nbytes:
            slot.view[:] = data
            self.early.give(data)
        slot.complete(conn.peer)

    def wait(self, slot: Slot, deadline: Deadline) -> int:
        """Block until ``slot`` is filled; return the sender's rank (group-local)."""
        conn = slot.conn
        key = id(slot)
        self.waits[key] = (slot, time.monotonic())
        try:
            while not slot.done:
                if conn is not None and conn.read_lock.acquire(blocking=False):
                    try:
                        self._read_until(conn, slot, deadline)
                    finally:
                        conn.read_lock.release()
                        if slot.nbytes < EAGER_REARM_BYTES:
                            self._due.add(conn)  # see rearm_due
                        else:
                            self._rearm(conn)
                else:
                    self._help(conn)
                    self._heartbeat()
                    self.rearm_due()
                    if not slot.event.wait(min(0.01, max(0.0, deadline.remaining()))):
                        if deadline.expired() and not slot.done:
                            self._give_up(slot, deadline)
        finally:
            self.waits.pop(key, None)
        if slot.error is not None:
            raise self._operation_failed(slot.error)
        return slot.source

    # -- waits outside the mesh (shared memory) --------------------------------------------------

    def begin_wait(self, wait) -> int:
        """Register a wait on a peer that is not a posted receive (``wait`` has ``conn``,
        ``what``, ``sending`` and ``fail(error)``): the heartbeats report it, as they report
        receives. Returns the key for end_wait."""
        key = id(wait)
        self.waits[key] = (wait, time.monotonic())
        return key

    def end_wait(self, key: int) -> None:
        self.waits.pop(key, None)

    def wait_timed_out(self, wait, deadline: Deadline) -> DistBackendError:
        """The error of a registered wait whose deadline passed (who is alive, who is silent);
        the mesh is aborted with it, as for a receive."""
        self._give_up(wait, deadline)
        return wait.error

    def beat(self) -> None:
        """Send the heartbeat now if one is due (a waiting thread may be the only one free)."""
        self._heartbeat()

    def check_peer(self, peer: int) -> None:
        """Raise if the mesh failed or ``peer``'s connection is gone (aborting the group: an
        operation needs that peer)."""
        if self.error is not None:
            raise self.error
        conn = self.conns[peer]
        if conn is not None and conn.failed is not None:
            self._check(conn)

    def _troubled(self) -> None:
        for hook in list(self.trouble_hooks):
            try:
                hook()
            except Exception:  # noqa: BLE001 - a hook must not stop the failure from spreading
                log.exception("%s: a wake-up hook failed", self.label)

    def _operation_failed(self, error: BaseException) -> BaseException:
        """What an operation whose receive failed raises: its own error, after telling the
        other ranks (abort), unless the mesh had already learnt the cause. A peer that aborts
        closes its connections, and its ABORT can arrive on another connection than the one
        whose close this rank saw first (or be lost to a reset); the cause beats the symptom."""
        if getattr(error, "connection_lost", False) and self.error is not None \
                and not getattr(self.error, "connection_lost", False):
            return self.error
        self.abort(error)  # this operation failed: tell the other ranks
        return error

    def try_wait(self, slot: Slot, deadline: Deadline) -> bool:
        """Like wait, but a deadline that passes withdraws the receive and returns False
        instead of aborting the group (monitored_barrier's "who did not come")."""
        conn = slot.conn
        while not slot.done:
            if deadline.expired():
                if conn is not None and self.matching.withdraw(conn.peer, slot):
                    return False
                # not posted any more: a reader is filling it right now
            if conn is not None and conn.read_lock.acquire(blocking=False):
                try:
                    self._read_until(conn, slot, deadline, give_up=False)
                finally:
                    conn.read_lock.release()
                    self._rearm(conn)
            else:
                slot.event.wait(min(0.01, max(0.001, deadline.remaining())))
        if slot.error is not None:
            raise slot.error
        return True

    def _read_until(self, conn: PeerConnection, slot: Slot, deadline: Deadline, give_up: bool = True) -> None:
        while not slot.done:
            if conn.failed is not None:  # its EOF was read already: nothing more will come
                slot.fail(conn.failed)
                return
            left = deadline.remaining()
            if left <= 0:
                if give_up:
                    self._give_up(slot, deadline)
                return
            if not self._spin(conn):
                self.rearm_due()  # about to sleep: the progress thread watches the others again
                if not conn.poller.poll(min(left, 0.2) * 1000):
                    if self.error is not None:
                        slot.fail(self.error)
                    self._help(conn)
                    self._heartbeat()
                    continue
            self._read_frame(conn)

    def _spin(self, conn: PeerConnection) -> bool:
        """Poll ``conn`` without sleeping for up to SPIN_S; True if data arrived.

        Why: a blocked thread's vCPU halts on these VMs, and waking it costs ~100 µs — as much
        as a small collective. When the frame comes within the window (a peer on the same
        host answering at once) the wake-up is saved. When frames keep missing the window
        (more ranks than cores, a slow peer, large transfers), spinning only takes CPU from
        the ranks that would send, so the mesh backs off in time (busy_poll.py): a phase of
        small collectives after large ones spins again within about 80 ms.
        """
        return self._busy_poll.spin(partial(conn.poller.poll, 0)) is not None

    def _give_up(self, slot: Slot, deadline: Deadline) -> None:
        who = slot.conn.name() if slot.conn is not None else "any rank"
        error = DistBackendError(
            f"{self.label}: rank {self.rank} timed out after {format_duration(deadline.seconds)} waiting for "
            f"{slot.what} from {who}. {self._diagnose(slot)} The group is aborted; destroy it and init again")
        self.abort(error)
        slot.fail(error)

    def _diagnose(self, slot: Slot) -> str:
        """Who is alive (and waiting on whom) and who has gone silent, from the heartbeats."""
        now = time.monotonic()
        parts = []
        awaited = slot.conn
        if awaited is not None:
            if awaited.status and now - awaited.status_time < SILENT_AFTER:
                parts.append(f"{awaited.name()} is alive: it is {awaited.status}.")
            else:
                parts.append(f"{awaited.name()} has been silent for {now - awaited.last_heard:.0f}s.")
        silent = [c for c in self.conns if c is not None and c.failed is None and now - c.last_heard > SILENT_AFTER]
        if silent:
            names = ", ".join(f"{c.name()} for {now - c.last_heard:.0f}s" for c in silent)
            parts.append(f"Silent: {names} — likely cut off from the network, stopped, or stuck outside "
                         f"distlib (the ranks that are waiting say so every {HEARTBEAT_INTERVAL:.0f}s).")
        return " ".join(parts) or "That rank is slow, stuck in another operation, or unreachable."

    def _help(self, busy: Optional[PeerConnection]) -> None:
        """While waiting, read whatever other connections have (an ABORT, a frame some other
        receive waits for): a progress thread stuck in the middle of a frame from a peer that
        vanished must not keep the others' news from being read."""
        for conn in self.conns:
            if conn is None or conn is busy or conn.failed is not None or self.closed:
                continue
            if not conn.read_lock.acquire(blocking=False):
                continue  # (poll objects must not be used by two threads at once: lock first)
            try:
                while conn.failed is None and self.error is None and conn.poller.poll(0):
                    self._read_frame(conn)
            finally:
                conn.read_lock.release()
                self._due.add(conn)

    def rearm_due(self) -> None:
        """Hand the connections that waiting threads have read back to the progress thread.

        Why not at once (after small frames; large ones re-arm at once, EAGER_REARM_BYTES):
        a thread that waits for a frame reads its connection itself, and
        while it goes from one operation to the next (one small collective after another)
        a re-armed connection would wake the progress thread for every frame, only to find
        the frame taken or to take it and make the waiter wait for a hand-off (and both
        threads contend for the interpreter lock, a futex call each way). So they are
        re-armed when a thread is about to sleep (in a receive, a send the peer does not
        read, a wait in shared memory), when a point-to-point receive is posted (nobody may
        wait for it), and by the progress thread whenever no thread waits. A frame that comes
        in the meantime waits in the kernel for the next receive, which reads it directly.
        """
        due = self._due
        while due:
            try:
                conn = due.pop()
            except KeyError:
                return
            self._rearm(conn)

    # -- reading frames (the caller holds conn.read_lock) ---------------------------------------

    def _recv_into(self, conn: PeerConnection, view: memoryview, what: str) -> None:
        """Fill ``view`` from the socket; the sender is mid-frame, so bytes come promptly."""
        deadline = None
        sock = conn.sock
        while view.nbytes:
            try:
                n = sock.recv_into(view, view.nbytes, socket.MSG_WAITALL)
            except (BlockingIOError, InterruptedError):
                n = -1  # a SLICE passed without data
            except OSError as exc:
                raise self._peer_lost(conn, f"receiving {what}", exc) from None
            if n == 0:
                raise self._peer_lost(conn, f"receiving {what}", None)
            if n > 0:
                view = view[n:]
                continue
            if self.closed or self.error is not None:
                if self.error is None:
                    closed = DistBackendError(f"{self.label}: the process group was destroyed")
                    closed.connection_lost = True
                    raise closed
                raise self.error
            deadline = deadline or Deadline(self.timeout_s)
            if deadline.expired():
                raise self._timeout(conn, f"the rest of {what}", deadline)
            self._heartbeat()  # this thread may be the progress thread: it still beats

    def _read_frame(self, conn: PeerConnection) -> None:
        """Read one frame from ``conn`` and deliver it; on failure abort the mesh."""
        slot: Optional[Slot] = None
        try:
            header = memoryview(conn.header)
            self._recv_into(conn, header, "a frame header")
            fields = frames.unpack(conn.header)
            kind, op, dtype, redop, seq, step, count, nbytes = fields
            conn.last_heard = time.monotonic()
            if kind == HEARTBEAT:
                text = bytearray(nbytes)
                self._recv_into(conn, memoryview(text), "a heartbeat")
                conn.status = text.decode("utf-8", "replace")
                conn.status_time = conn.last_heard
                problem = self.matching.waiting_in(conn.peer, fields) if op else None
                if problem:
                    raise DistBackendError(f"{self.label}: {problem}")
                return
            if kind == ABORT:
                text = bytearray(nbytes)
                self._recv_into(conn, memoryview(text), "an abort message")
                origin = seq  # the rank that detected the failure
                reporter = self.conns[origin].name() if 0 <= origin < self.size and self.conns[origin] \
                    else f"rank {origin}"
                message = text.decode("utf-8", "replace")
                self._fail_everything(DistBackendError(f"{message} (reported by {reporter})"), message, origin)
                return
            if kind not in (DATA, P2P):
                raise DistBackendError(f"{self.label}: {conn.name()} sent an unknown frame kind {kind}")
            slot = self.matching.take(conn.peer, kind, seq, step)
            if slot is not None:
                if slot.conn is None:
                    slot.conn = conn  # a receive from any source
                problem = slot.mismatch(op, dtype, redop, nbytes, count, conn.name())
                if problem:
                    self._mismatch(slot, problem)
                    return
                if nbytes:
                    self._recv_into(conn, slot.view, slot.what)
                slot.complete(conn.peer)
                return
            data = self.early.take(nbytes)
            if nbytes:
                self._recv_into(conn, memoryview(data), "an early frame")
            slot, problem = self.matching.arrive(conn.peer, fields, data)
            if slot is None:
                if problem:
                    raise DistBackendError(f"{self.label}: {problem}")
                return
            if slot.conn is None:
                slot.conn = conn
            problem = slot.mismatch(op, dtype, redop, nbytes, count, conn.name())
            if problem:
                self._mismatch(slot, problem)
                return
            if nbytes:
                slot.view[:] = data
                self.early.give(data)
            slot.complete(conn.peer)
        except DistBackendError as error:
            if slot is not None and not slot.done:
                slot.fail(error)  # taken out of the table for this frame, then the frame broke off
            if not getattr(error, "connection_lost", False):
                self.abort(error)
            # else: _peer_lost failed whatever else waited on that connection; others go on

    def _mismatch(self, slot: Slot, problem: str) -> None:
        """A frame does not fit the receive it matched: fail that receive (already taken out
        of the table) and abort the mesh, so every rank learns why. The frame's payload stays
        unread: the connection is not used again."""
        error = DistBackendError(f"{self.label}: {problem}")
        slot.fail(error)
        self.abort(error)

    # -- the progress thread ---------------------------------------------------------------------

    def _progress_loop(self) -> None:
        try:
            self._progress_steps()
        except BaseException as exc:  # noqa: BLE001 - never die silently: fail the mesh with why
            if not self.closed:
                log.exception("%s: progress thread failed", self.label)
                self.abort(DistBackendError(f"{self.label}: rank {self.rank}'s progress thread failed: "
                                            f"{type(exc).__name__}: {exc}"))

    def _progress_steps(self) -> None:
        while not self.closed:
            try:
                events = self._epoll.poll(HEARTBEAT_INTERVAL)
            except InterruptedError:
                continue
            except (OSError, ValueError):
                return
            if self.waits:
                self._heartbeat()
            else:
                self.rearm_due()  # no thread is waiting: nobody else reads them
            for fd, _ in events:
                if fd == self._wake_r:
                    try:
                        os.read(self._wake_r, 64)
                    except OSError:
                        pass
                    continue
                conn = self.by_fd.get(fd)
                if conn is None or conn.failed is not None:
                    continue
                if not conn.read_lock.acquire(blocking=False):
                    continue  # a waiting thread is reading it; it re-arms when done
                try:
                    while conn.failed is None and self.error is None and not self.closed and conn.poller.poll(0):
                        self._read_frame(conn)
                finally:
                    conn.read_lock.release()
                    self._rearm(conn)

    def _heartbeat(self) -> None:
        """Tell every peer what this rank has been waiting for (if for a while).

        Called by the progress thread and by every thread that waits (receiving, or sending
        to a peer that does not read), at most once per HEARTBEAT_INTERVAL in all: any one of
        them may be the thread that is stuck (the progress thread in the middle of a frame
        from a peer that was cut off), and the rank must not fall silent because of it.
        """
        now = time.monotonic()
        if now - self._last_beat < HEARTBEAT_INTERVAL:
            return
        oldest = min(list(self.waits.values()), key=lambda item: item[1], default=None)
        if oldest is None or now - oldest[1] < HEARTBEAT_INTERVAL:
            return
        self._last_beat = now
        slot, since = oldest
        who = slot.conn.name() if slot.conn is not None else "any rank"
        if slot.sending:
            data = f"waiting {now - since:.0f}s to send {slot.what} to {who} (it is not reading)".encode("utf-8")
        else:
            data = f"waiting {now - since:.0f}s for {slot.what} from {who}".encode("utf-8")
        op, dtype, redop, seq, count = getattr(slot, "operation", None) or (0, 0, 0, 0, 0)
        frame = frames.pack(HEARTBEAT, op, dtype, redop, seq, 0, count, len(data)) + data
        for conn in self.conns:
            if conn is None or conn.failed is not None or not conn.send_lock.acquire(blocking=False):
                continue
            try:
                if conn.leftover:
                    continue  # the last one is still not out: the peer is not reading
                try:
                    sent = conn.sock.send(frame, socket.MSG_DONTWAIT)
                except (BlockingIOError, InterruptedError):
                    sent = 0
                except OSError:
                    continue
                if 0 < sent < len(frame):
                    conn.leftover = frame[sent:]
            finally:
                conn.send_lock.release()

    def _rearm(self, conn: PeerConnection) -> None:
        if conn.failed is None and not self.closed:
            try:
                self._epoll.modify(conn.fd, _EPOLLIN_ONCE)
            except (OSError, ValueError):
                pass

    # -- failure ---------------------------------------------------------------------------------

    def _conn(self, peer: int, what: str) -> PeerConnection:
        if self.error is not None:
            raise self.error
        conn = self.conns[peer] if 0 <= peer < self.size else None
        if conn is None:
            raise DistBackendError(f"{self.label}: rank {self.rank} has no connection to rank {peer} ({what})")
        return conn

    def _check(self, conn: PeerConnection) -> None:
        if self.error is not None:
            raise self.error
        if conn.failed is not None:
            self.abort(conn.failed)  # an operation needs a peer that is gone: it fails for all
            raise conn.failed

    def _peer_lost(self, conn: PeerConnection, doing: str, exc: Optional[OSError]) -> DistBackendError:
        """The connection to one peer is gone: fail what waits on it (not the whole mesh: a
        peer that finished and destroyed its group closes its connections while others are
        still busy with each other). An operation that needed the peer fails, and that
        failure aborts the mesh."""
        cause = "closed the connection" if exc is None or exc.errno in (errno.EPIPE, errno.ECONNRESET) \
            else f"connection failed ({exc.strerror})"
        error = DistBackendError(
            f"{self.label}: {conn.name()} {cause} while rank {self.rank} was {doing}: "
            f"rank {conn.peer} died, was killed, or destroyed its process group")
        error.connection_lost = True  # only that connection is gone (see _read_frame)
        with self.matching.lock:
            if conn.failed is None:
                conn.failed = error
            slots = self.matching.drain_peer(conn.peer)
        log.debug("%s", error)
        for slot in slots:
            slot.fail(conn.failed)
        self._troubled()
        return conn.failed

    def _timeout(self, conn: PeerConnection, doing: str, deadline: Deadline) -> DistBackendError:
        error = DistBackendError(
            f"{self.label}: rank {self.rank} timed out after {format_duration(deadline.seconds)} {doing} "
            f"with {conn.name()}")
        self.abort(error)
        return error

    def abort(self, error: DistBackendError) -> None:
        """Tell every peer why, then fail every pending and later operation with ``error``."""
        self._fail_everything(error, str(error), self.rank)

    def _fail_everything(self, error: DistBackendError, message: str, origin: int) -> None:
        """Fail everything with ``error`` and pass the ABORT on to every peer.

        A rank that receives an ABORT forwards it too, before it can close anything: each
        connection delivers in order, so every rank reads the original reason before it could
        see any connection close because another rank gave up (the reason, not a symptom)."""
        with self.matching.lock:
            if self.error is not None:
                return
            self.error = error
            slots = self.matching.drain_all()
        log.error("%s: aborting: %s", self.label, error)
        data = message.encode("utf-8")
        frame = frames.pack(ABORT, 0, 0, 0, origin, 0, 0, len(data)) + data
        for conn in self.conns:
            if conn is None or conn.failed is not None or conn.peer == origin:
                continue
            try:
                if conn.send_lock.acquire(timeout=0.5):
                    try:
                        conn.sock.send(frame)
                    finally:
                        conn.send_lock.release()
            except OSError:
                pass
        for slot in slots:
            slot.fail(error)
        self._troubled()

    def close(self) -> None:
        """Close every connection and stop the progress thread (idempotent)."""
        if self.closed:
            return
        self.closed = True
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass
        if self._progress is not None and self._progress is not threading.current_thread():
            self._progress.join(2.0)
        for conn in self.conns:
            if conn is not None:
                try:
                    conn.sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in recv on it
                except OSError:
                    pass
                try:
                    conn.sock.close()
                except OSError:
                    pass
        if self.listener is not None:
            self.listener.close()
        self._epoll.close()
        os.close(self._wake_r)
        os.close(self._wake_w)
        self.early.clear()
        with self.matching.lock:
            if self.error is None:
                self.error = DistBackendError(f"{self.label}: the process group was destroyed")
            self.matching.settled = True
        self._troubled()
