"""TLS handshakes of the store server's new connections, on a thread of their own.

Why: a server's TLS handshake costs a few hundred microseconds of CPU (a key exchange and a
signature), and anyone who reaches the port can start one (the token is checked inside TLS).
On the event loop, about 630 handshakes a second from two clients without the token took
a good client's get from 0.20 to 1.33 ms at the median and its connect from 9 to 30 ms (issue
28): every handshake held up every request behind it. Here they run on a helper thread with
its own epoll; OpenSSL releases the GIL while it computes, so the loop goes on serving its
clients meanwhile (on another CPU when there is one).

The loop hands a connection over right after accept (``submit``) and does not touch it until
the thread hands it back (``finished``, then the loop's wake-up callback): with the
handshake done (the connection's next step set by admission.py, the token's challenge
queued), or with the ``Refused`` that the loop logs and closes it with. A connection still in
its handshake at its admission deadline is handed back refused, and so is one the loop
``drop``s (a stranger that must make room, or that did not prove itself in time: intake.py).
Only the TLS steps run here; the token's exchange and VALIDATE are cheap and stay on the loop.
"""

from __future__ import annotations

import collections
import os
import select
import threading
import time
from typing import Any, Callable, Deque, Dict, Optional, Tuple

from .admission import TIMEOUT_S, TLS_DONE, WANT_WRITE, Admission, Refused

#: Connection -> its outcome: None (the handshake is done) or why it was refused.
Finished = Tuple[Any, Optional[Refused]]  # (a Connection, why it was refused)


class TlsHandshakes:
    """The handshake thread of one server. ``submit(conn)`` from the loop; ``finished`` holds
    what comes back, in order; ``close()`` stops the thread (the loop then closes whatever it
    handed over and did not get back)."""

    def __init__(self, admission: Admission, wake: Callable[[], None], name: str = "distlib-store-tls"):
        self.admission = admission
        self.wake = wake
        self.finished: Deque[Finished] = collections.deque()
        self._incoming: Deque = collections.deque()
        self._dropping: Deque[Finished] = collections.deque()  # (conn, why), from the loop
        self._conns: Dict[int, Any] = {}  # fd -> Connection
        self._by_deadline: Deque = collections.deque()  # in submission order: deadlines ascend
        self._ep = select.epoll()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._ep.register(self._wake_r, select.EPOLLIN)
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, conn) -> None:
        """Take ``conn`` (accepted, its gate at the TLS step) through its handshake."""
        self._incoming.append(conn)
        self._poke()

    def drop(self, conn, refusal: Refused) -> None:
        """Hand ``conn`` back with ``refusal`` if it is still in its handshake (from the loop;
        a connection already handed back is not handed back twice)."""
        self._dropping.append((conn, refusal))
        self._poke()

    def close(self, timeout: float = 5.0) -> None:
        self._stopping = True
        self._poke()
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self._ep.close()
            os.close(self._wake_r)
            os.close(self._wake_w)

    def _poke(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass  # the pipe is full (the thread will wake) or closed (stopping)

    # -- the thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        poll = self._ep.poll
        conns = self._conns
        while not self._stopping:
            events = poll(self._timeout())
            for fd, _ev in events:
                conn = conns.get(fd)
                if conn is not None:
                    self._step(conn)
                elif fd == self._wake_r:
                    try:
                        os.read(fd, 4096)
                    except OSError:
                        pass
            while self._incoming:
                conn = self._incoming.popleft()
                conns[conn.fd] = conn
                self._by_deadline.append(conn)
                self._ep.register(conn.fd, select.EPOLLIN)
                self._step(conn)
            while self._dropping:
                conn, refusal = self._dropping.popleft()
                if conns.get(conn.fd) is conn:
                    self._finish(conn, refusal)
            self._expire()

    def _timeout(self) -> float:
        order = self._by_deadline
        while order and self._conns.get(order[0].fd) is not order[0]:
            order.popleft()
        return -1 if not order else max(0.0, order[0].gate.deadline - time.monotonic())

    def _step(self, conn) -> None:
        try:
            outcome = self.admission.advance_tls(conn)
        except Refused as exc:
            self._finish(conn, exc)
            return
        if outcome == TLS_DONE:
            self._finish(conn, None)
        else:
            self._ep.modify(conn.fd, select.EPOLLOUT if outcome == WANT_WRITE else select.EPOLLIN)

    def _expire(self) -> None:
        now = time.monotonic()
        order = self._by_deadline
        # (mypy narrows order[0] to the dict's Optional through `is not`: the ignore below)
        while order and (self._conns.get(order[0].fd) is not order[0] or order[0].gate.deadline <= now):  # type: ignore[union-attr]
            conn = order.popleft()
            if self._conns.get(conn.fd) is conn:
                self._finish(conn, Refused(f"refused: did not complete the TLS handshake within {TIMEOUT_S:g} s of "
                                           f"connecting"))

    def _finish(self, conn, refusal: Optional[Refused]) -> None:
        del self._conns[conn.fd]
        try:
            self._ep.unregister(conn.fd)
        except (OSError, ValueError):
            pass
        self.finished.append((conn, refusal))
        self.wake()
