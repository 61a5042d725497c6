"""``Mesh``: one TCP connection between every pair of ranks of a group, and how bytes move on it.

The mesh is made of four parts, each in its module:

* connection.py: the connections and their handshakes (``Connector``, ``PeerConnection``);
* matching.py: the posted receives and the frames that came first (``Matching``, ``Slot``),
  no sockets in it;
* progress.py: the thread that reads connections no waiting thread reads (``Progress``);
* health.py: heartbeats, diagnosis, abort and the wake-up hooks (``Health``), which the
  shared-memory channel (shm_channel.py) is given too.

This module joins them: sending, posting and waiting, and reading frames.

Moving bytes (frames.py for the layout):

* **Sends** are done by the calling thread, header and payload in one ``sendmsg`` of
  memoryviews (no copy), on non-blocking sockets polled against the operation's deadline.
* **Receives are posted** (a buffer and what is expected) and matched to incoming frames:
  DATA by ``(seq, step)``, P2P first-in-first-out per (peer, tag). A frame whose receive
  is already posted is read straight into that buffer (``recv_into``, no copy); one that
  arrives early is kept until its receive is posted (matching.py holds those tables).
* **Who reads:** the thread waiting for a frame reads the connection itself when no other
  thread is reading it (one wake-up, not two: a hand-off between threads costs ~100 µs on
  these VMs). A progress thread reads every other connection that has data (progress.py).
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

import socket
import time
from functools import partial
from typing import List, Optional, Sequence, Tuple

from ....busy_poll import BusyPoll
from ....deadline import Deadline
from ....errors import DistBackendError
from . import frames
from .connection import Connector, PeerConnection, peer_connection
from .early import EarlyBuffers
from .frames import ABORT, DATA, HEARTBEAT, P2P
from .health import BlockedSend, Health
from .matching import LOST, Matching, Slot
from .progress import Progress

ANY_SOURCE = -1
#: How long a waiting reader polls before it blocks (busy_poll.py, backing off in time; 0
#: turns it off).
SPIN_S = 80e-6
#: After a wait for a frame of at least this many bytes the connection goes back to the
#: progress thread at once (Progress.rearm): in a large transfer it receives the next piece
#: while this thread sends one (64 MiB all_reduce over TCP, 2 ranks: half the bandwidth without).
EAGER_REARM_BYTES = 256 << 10


class Mesh:
    """The connections of one process group (or of one interface of it)."""

    def __init__(self, rank: int, size: int, timeout_s: float, mesh_id: int, label: str,
                 token: Optional[bytes] = None):
        self.rank = rank
        self.size = size
        self.timeout_s = timeout_s
        self.mesh_id = mesh_id
        self.label = label
        #: The job's token: every connection is authenticated with it (None: not at all).
        self.token = token
        self.connector = Connector(rank, size, mesh_id, label, token)
        self.listener: Optional[socket.socket] = None
        self.conns: List[Optional[PeerConnection]] = [None] * size
        #: Posted receives and the frames that came before theirs
        self.matching = Matching(size, self._name_of)
        #: Heartbeats, diagnosis, abort, the wake-up hooks (shared with the shm channel)
        self.health = Health(rank, label, self.conns, self.matching)
        self.progress = Progress(rank, label, self.health, self.read_frame)
        self.health.before_sleep = self.progress.rearm_due
        self.early = EarlyBuffers()  # frames that arrive before their receive is posted
        self.closed = False
        # Not yielding to runnable tasks: peers are often on other hosts, and the back-off
        # covers a host with more ranks than cores.
        self._busy_poll = BusyPoll(SPIN_S, yield_cpu=False, backoff=True)

    @property
    def error(self) -> Optional[DistBackendError]:
        """Why the group failed (or that it was destroyed); None while it works."""
        return self.health.error

    # -- establishing ----------------------------------------------------------------------------

    def connect_all(self, addresses: Sequence[Tuple[str, int]], deadline: Deadline,
                    rcvbuf: Sequence[int] = ()) -> None:
        """Connect to every lower rank, accept every higher one (connection.py), start the
        progress thread. ``rcvbuf[peer]``, where given and > 0, fixes that connection's SO_RCVBUF."""
        assert self.listener is not None, "set by the group's setup before connect_all"
        self.connector.connect_all(self.listener, addresses, deadline, rcvbuf, self._add, self.conns)
        self.progress.start()

    def add_connection(self, peer: int, sock: socket.socket, address: str) -> PeerConnection:
        """Use ``sock`` (its handshake done) as the connection to rank ``peer``."""
        conn = peer_connection(peer, sock, address)
        self._add(conn)
        return conn

    def _add(self, conn: PeerConnection) -> None:
        self.conns[conn.peer] = conn
        self.progress.watch(conn)

    def abort(self, error: DistBackendError) -> None:
        """Tell every peer why, then fail every pending and later operation with ``error``."""
        self.health.abort(error)

    def rearm_due(self) -> None:
        """Hand the connections waiting threads have read back to the progress thread."""
        self.progress.rearm_due()

    # -- sending ---------------------------------------------------------------------------------

    def send(self, peer: int, header: bytes, payload: memoryview, deadline: Deadline, what: object) -> None:
        """Send one frame to ``peer`` (header + payload, no copy of the payload)."""
        conn = self._conn(peer, what)
        with conn.send_lock:
            self.health.check(conn)
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
                        if self.health.error is not None:
                            raise self.health.error
                        if deadline.expired():
                            raise self.health.timeout(conn, f"sending {what} (the peer is not reading)", deadline)
                        if blocked_key is None:
                            # The peer's window is closed: this thread now waits on it, and
                            # the heartbeats must say so, or the ranks waiting on this one
                            # would count it as silent and blame it.
                            # (begin_wait hands the connections back to the progress thread:
                            # the peer may be blocked sending to this rank)
                            blocked_key = self.health.begin_wait(BlockedSend(conn, what))
                        self.health.beat()
            finally:
                if blocked_key is not None:
                    self.health.end_wait(blocked_key)

    def _send_failed(self, conn: PeerConnection, what: object, exc: Optional[OSError]) -> DistBackendError:
        error = self.health.peer_lost(conn, f"sending {what}", exc)
        return self.health.abort(error)

    # -- receiving -------------------------------------------------------------------------------

    def begin(self, seq: int, op: int, dtype: int, redop: int, count: int) -> None:
        """This rank starts collective ``seq`` on this mesh (Matching.begin): a frame that
        arrived before this call and contradicts it aborts the group now."""
        if self.health.error is not None:
            raise self.health.error  # the cause, not the frames its abort left unread
        stale = self.matching.begin(seq, op, dtype, redop, count)
        if stale:
            raise self.health.abort(DistBackendError(f"{self.label}: {stale}"))

    def _name_of(self, peer: int) -> str:
        conn = self.conns[peer]
        return conn.name() if conn is not None else f"rank {peer}"

    def post_data(self, peer: int, seq: int, step: int, view: memoryview, op: int, dtype: int, redop: int,
                  count: int, what: object) -> Slot:
        """Post the receive of a collective's frame ``(seq, step)`` from ``peer``."""
        conn = self._conn(peer, what)
        slot = Slot(view, DATA, op, dtype, redop, count, what, seq)
        slot.conn = conn
        kept = self.matching.post_data(peer, seq, step, slot)
        if kept is None:
            return slot
        if kept is LOST:
            self.health.check(conn)
        self._fill_from_early(conn, slot, *kept)
        return slot

    def post_p2p(self, peer: int, tag: int, view: memoryview, dtype: int, count: int, what: str) -> Slot:
        """Post a point-to-point receive from ``peer`` (or ANY_SOURCE) with ``tag``."""
        slot = Slot(view, P2P, frames.OPS["send"], dtype, 0, count, what)
        if self.health.error is not None:
            raise self.health.error
        self.progress.rearm_due()  # the progress thread fills it if nobody waits (irecv + is_completed)
        if peer != ANY_SOURCE:
            slot.conn = self._conn(peer, what)
        found = self.matching.post_p2p(None if peer == ANY_SOURCE else peer, tag, slot)
        if found is None:
            return slot
        if found is LOST:
            self.health.check(slot.conn)
        source, kept = found
        self._fill_from_early(self.conns[source], slot, *kept)
        return slot

    def _fill_from_early(self, conn: PeerConnection, slot: Slot, header: tuple, data: bytearray) -> None:
        if not self._fill(conn, slot, header, data):
            assert slot.error is not None, "_fill failed the receive"
            raise slot.error

    def wait(self, slot: Slot, deadline: Deadline) -> int:
        """Block until ``slot`` is filled; return the sender's rank (group-local)."""
        conn = slot.conn
        key = self.health.register(slot)
        try:
            while not slot.done:
                if conn is not None and conn.read_lock.acquire(blocking=False):
                    try:
                        self._read_until(conn, slot, deadline)
                    finally:
                        conn.read_lock.release()
                        if slot.nbytes < EAGER_REARM_BYTES:
                            self.progress.mark_due(conn)  # see rearm_due
                        else:
                            self.progress.rearm(conn)
                else:
                    self._help(conn)
                    self.health.beat()
                    self.progress.rearm_due()
                    if not slot.event.wait(min(0.01, max(0.0, deadline.remaining()))):
                        if deadline.expired() and not slot.done:
                            self.health.give_up(slot, deadline)
        finally:
            self.health.end_wait(key)
        if slot.error is not None:
            raise self.health.operation_failed(slot.error)
        return slot.source

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
                    self.progress.rearm(conn)
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
                    self.health.give_up(slot, deadline)
                return
            if not self._spin(conn):
                self.progress.rearm_due()  # about to sleep: the progress thread watches the others again
                if not conn.poller.poll(min(left, 0.2) * 1000):
                    if self.health.error is not None:
                        slot.fail(self.health.error)
                    self._help(conn)
                    self.health.beat()
                    continue
            self.read_frame(conn)

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
                while conn.failed is None and self.health.error is None and conn.poller.poll(0):
                    self.read_frame(conn)
            finally:
                conn.read_lock.release()
                self.progress.mark_due(conn)

    # -- reading frames (the caller holds conn.read_lock) ---------------------------------------

    def _recv_into(self, conn: PeerConnection, view: memoryview, what: object) -> None:
        """Fill ``view`` from the socket; the sender is mid-frame, so bytes come promptly."""
        deadline = None
        sock = conn.sock
        while view.nbytes:
            try:
                n = sock.recv_into(view, view.nbytes, socket.MSG_WAITALL)
            except (BlockingIOError, InterruptedError):
                n = -1  # a SLICE passed without data
            except OSError as exc:
                raise self.health.peer_lost(conn, f"receiving {what}", exc) from None
            if n == 0:
                raise self.health.peer_lost(conn, f"receiving {what}", None)
            if n > 0:
                view = view[n:]
                continue
            if self.closed or self.health.error is not None:
                if self.health.error is None:
                    closed = DistBackendError(f"{self.label}: the process group was destroyed")
                    closed.connection_lost = True
                    raise closed
                raise self.health.error
            deadline = deadline or Deadline(self.timeout_s)
            if deadline.expired():
                raise self.health.timeout(conn, f"the rest of {what}", deadline)
            self.health.beat()  # this thread may be the progress thread: it still beats

    def read_frame(self, conn: PeerConnection) -> None:
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
                self.health.heard(conn, text.decode("utf-8", "replace"))
                problem = self.matching.waiting_in(conn.peer, fields) if op else None
                if problem:
                    raise DistBackendError(f"{self.label}: {problem}")
                return
            if kind == ABORT:
                text = bytearray(nbytes)
                self._recv_into(conn, memoryview(text), "an abort message")
                self.health.aborted_by(seq, text.decode("utf-8", "replace"))  # seq: the rank that found it
                return
            if kind not in (DATA, P2P):
                raise DistBackendError(f"{self.label}: {conn.name()} sent an unknown frame kind {kind}")
            slot = self.matching.take(conn.peer, kind, seq, step)
            if slot is not None:
                self._fill(conn, slot, fields, None)  # straight from the socket into the receive
                return
            data = self.early.take(nbytes)
            if nbytes:
                self._recv_into(conn, memoryview(data), "an early frame")
            slot, problem = self.matching.arrive(conn.peer, fields, data)
            if slot is not None:
                self._fill(conn, slot, fields, data)  # posted while the payload was read
            elif problem:
                raise DistBackendError(f"{self.label}: {problem}")
        except DistBackendError as error:
            if slot is not None and not slot.done:
                slot.fail(error)  # taken out of the table for this frame, then the frame broke off
            if not getattr(error, "connection_lost", False):
                self.health.abort(error)
            # else: Health.peer_lost failed whatever else waited on that connection; others go on

    def _fill(self, conn: PeerConnection, slot: Slot, fields: tuple, data: Optional[bytearray]) -> bool:
        """Fill ``slot`` (taken out of the tables) with a frame from ``conn``: its payload is
        ``data`` (kept), or still in the socket (None). False if the frame does not fit the
        receive: the receive failed and the group is aborted (_mismatch)."""
        _, op, dtype, redop, _, _, count, nbytes = fields
        if slot.conn is None:
            slot.conn = conn  # a receive from any source
        problem = slot.mismatch(op, dtype, redop, nbytes, count, conn.name())
        if problem:
            self._mismatch(slot, problem)
            return False
        if nbytes:
            if data is None:
                self._recv_into(conn, slot.view, slot.what)
            else:
                slot.view[:] = data
                self.early.give(data)
        slot.complete(conn.peer)
        return True

    def _mismatch(self, slot: Slot, problem: str) -> None:
        """A frame does not fit the receive it matched: fail that receive (already taken out
        of the table) and abort the mesh, so every rank learns why. The frame's payload stays
        unread: the connection is not used again."""
        slot.fail(self.health.abort(DistBackendError(f"{self.label}: {problem}")))

    # -- failure and teardown --------------------------------------------------------------------

    def _conn(self, peer: int, what: object) -> PeerConnection:
        if self.health.error is not None:
            raise self.health.error
        conn = self.conns[peer] if 0 <= peer < self.size else None
        if conn is None:
            raise DistBackendError(f"{self.label}: rank {self.rank} has no connection to rank {peer} ({what})")
        return conn

    def close(self) -> None:
        """Close every connection and stop the progress thread (idempotent)."""
        if self.closed:
            return
        self.closed = True
        self.progress.stop()
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
        self.progress.close()
        self.early.clear()
        self.health.destroyed()
