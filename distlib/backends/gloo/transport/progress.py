"""``Progress``: the thread that reads a mesh's connections when no waiting thread does.

The thread waiting for a frame reads its connection itself when no other thread is reading
it (one wake-up, not two: a hand-off between threads costs ~100 µs on these VMs). This
thread reads every other connection that has data (epoll, one-shot per connection), so a
peer's send never blocks because this rank is busy elsewhere (no send/send deadlock, whatever
order isend/irecv are issued in), and a peer that dies is noticed at once. It also sends the
heartbeats while threads wait (health.py).

A connection a waiting thread has read goes back to this thread later (``mark_due``, then
``rearm_due``: see there) or at once (``rearm``).
"""

from __future__ import annotations

import os
import select
import threading
from typing import Callable, Dict, Optional, Set

from ....errors import DistBackendError
from .connection import PeerConnection
from .health import HEARTBEAT_INTERVAL, Health, log

_EPOLLIN_ONCE = select.EPOLLIN | select.EPOLLONESHOT


class Progress:
    """The progress thread of one mesh (rank ``rank``, named ``label``): it reads frames with
    ``read_frame(conn)`` (the caller holds ``conn.read_lock``) and reports to ``health``."""

    def __init__(self, rank: int, label: str, health: Health, read_frame: Callable[[PeerConnection], None]):
        self.rank = rank
        self.label = label
        self.health = health
        self.read_frame = read_frame
        self.closed = False
        self.by_fd: Dict[int, PeerConnection] = {}
        # connections a waiting thread has read and not re-armed (see rearm_due)
        self._due: Set[PeerConnection] = set()
        self._epoll = select.epoll()
        self._wake_r, self._wake_w = os.pipe()
        self._epoll.register(self._wake_r, select.EPOLLIN)
        self._thread: Optional[threading.Thread] = None

    def watch(self, conn: PeerConnection) -> None:
        """Read ``conn`` from now on (armed: its first frame wakes the thread)."""
        self.by_fd[conn.fd] = conn
        self._epoll.register(conn.fd, _EPOLLIN_ONCE)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name=f"distlib-progress-{self.label}", daemon=True)
        self._thread.start()

    def alive(self) -> bool:
        """Whether the thread runs (or has not started yet)."""
        return self._thread is None or self._thread.is_alive()

    # -- handing connections back ----------------------------------------------------------------

    def rearm(self, conn: PeerConnection) -> None:
        """Hand ``conn`` back to the thread now."""
        if conn.failed is None and not self.closed:
            try:
                self._epoll.modify(conn.fd, _EPOLLIN_ONCE)
            except (OSError, ValueError):
                pass

    def mark_due(self, conn: PeerConnection) -> None:
        """A waiting thread has read ``conn``: hand it back at the next rearm_due."""
        self._due.add(conn)

    def rearm_due(self) -> None:
        """Hand the connections that waiting threads have read back to the progress thread.

        Why not at once (after small frames; large ones re-arm at once, tcp.EAGER_REARM_BYTES):
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
            self.rearm(conn)

    # -- the thread ------------------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            self._steps()
        except BaseException as exc:  # noqa: BLE001 - never die silently: fail the mesh with why
            if not self.closed:
                log.exception("%s: progress thread failed", self.label)
                self.health.abort(DistBackendError(f"{self.label}: rank {self.rank}'s progress thread failed: "
                                                   f"{type(exc).__name__}: {exc}"))

    def _steps(self) -> None:
        health = self.health
        while not self.closed:
            try:
                events = self._epoll.poll(HEARTBEAT_INTERVAL)
            except InterruptedError:
                continue
            except (OSError, ValueError):
                return
            if health.waits:
                health.beat()
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
                    while conn.failed is None and health.error is None and not self.closed and conn.poller.poll(0):
                        self.read_frame(conn)
                finally:
                    conn.read_lock.release()
                    self.rearm(conn)

    def stop(self) -> None:
        """Stop the thread (waiting up to 2 s for it), before the connections close."""
        self.closed = True
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(2.0)

    def close(self) -> None:
        """Release the poller (after stop, once the connections are closed)."""
        self._epoll.close()
        os.close(self._wake_r)
        os.close(self._wake_w)
