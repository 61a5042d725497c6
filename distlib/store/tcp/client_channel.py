"""The client end of one TCPStore connection: sending requests and reading replies, each with
a deadline (``RequestChannel``, the base of ``TCPStore`` in client.py, which speaks the
protocol over it).

* **Replies are polled for**, not blocked on at once: a short busy-poll (``SPIN_S``, 100 us;
  off when it would take a CPU another task needs, and backing off while replies miss it;
  distlib/busy_poll.py), then poll(2) with the deadline. The socket
  stays non-blocking, so no call pays for switching modes or timeouts.
* **Every reply is read with a deadline**: one that must come at once gets max(store timeout,
  ``MIN_REPLY_DEADLINE``); a WAIT's the wait's own timeout, then CANCEL_WAIT and torch's
  two-byte race. A server that stops answering is reported, naming the operation and the
  server, and the connection is then unusable.
* **In-process clients keep the server's order.** A client whose server runs on a thread of
  this process (``TCPStore(is_master=True)``'s handle, its clones; in_process.py) follows
  each request that has no reply (set, append, multi_set, queue_push) with a PING in the
  same write, and reads the echo before its next request. Why: that server thread waits
  for this interpreter, so it can still hold the handle's SET unread when another client's
  request arrives; the handle's next request then joins the SET in one read and runs ahead
  of a request the server had already received (a torch client's APPEND, then the master's
  GET, read the old value). torch's server thread needs no interpreter and never lags so;
  with the echo read first, the next request reaches the server after everything it had
  received, as it does there. The price: a stream of sets from the master handle pays a
  round trip per set (bench/performance-log.md). Such a client does not busy-poll either.
"""

from __future__ import annotations

import select
import socket
import time
from functools import partial
from typing import Any, Callable, List, Optional

from ...busy_poll import BusyPoll
from ...deadline import format_duration
from ...errors import DistNetworkError
from . import codec
from .codec import I64, STOP_WAITING, U32, U64, WAIT_CANCELED
from .handshake import CLOSED_TEXT

#: Replies to requests that do not wait (SET, ADD, GET after its WAIT, ...) come at once from a
#: healthy server; one that has not answered after max(store timeout, this) is reported dead.
MIN_REPLY_DEADLINE = 30.0

#: How long a client polls for a reply before blocking (busy_poll.py; see _recv).
SPIN_S = 100e-6

#: The nonce of the PING an in-process client sends after a request without reply (see the
#: module docstring); any value would do, this one reads as "confirm" in a dump.
CONFIRM_NONCE = 0xC0F1_12ED
_CONFIRM_REQUEST = codec.ping(CONFIRM_NONCE)
#: Up to this size a request without reply and its PING go out as one write (one copy of the
#: request); a larger request is sent as it is, and the PING after it.
_CONFIRM_JOIN_MAX = 65536

_RECV_SIZE = 65536
_POLLIN = select.POLLIN
_POLLOUT = select.POLLOUT
_u64 = U64.unpack_from
_i64 = I64.unpack_from
_CLOSED_TEXT = CLOSED_TEXT


class WaitTimedOut(Exception):
    """The reply to a WAIT did not come within the wait's timeout."""


class ConnectionLost(DistNetworkError):
    """The connection ended under a request (closed by the server, reset, a send or receive
    that failed): a client that reconnects (client.py) catches this one; a server that stops
    answering within the deadline is not this."""


#: Requests without reply a reconnecting client keeps for re-sending; past this many since the
#: last reply, it confirms them with a PING round trip and forgets them.
MAX_UNACKED = 256


def close_socket(sock: socket.socket) -> None:
    try:
        sock.close()
    except OSError:
        pass


class RequestChannel:
    """Requests out, replies in, over one non-blocking socket (``_attach``), for TCPStore.

    Args of ``_init_channel``: ``in_process``, whether the server runs on a thread of this
    process (it decides the confirmations and the busy-poll). TCPStore provides
    ``_timeout_s`` (the store timeout) and ``describe()`` (the server, for every error).
    Raises: DistNetworkError from every method once the connection failed, naming the
    server and what was being done; the channel is then unusable (``_broken``).
    """

    _timeout_s: float

    def describe(self) -> str:
        raise NotImplementedError

    def _init_channel(self, in_process: bool) -> None:
        self._sock: Any = None  # once attached: the socket, or a TlsSocket over it
        self._rbuf = bytearray()
        self._broken: Optional[str] = None
        self._recv_probe: Optional[Callable[[], bytes]] = None  # a non-blocking recv, once attached
        self._poller: Optional[select.poll] = None
        self._unconfirmed: Optional[str] = None  # the request whose PING echo is still to be read
        # An in-process client confirms requests without reply (module docstring) and never
        # spins for a reply: the spinning thread would keep the interpreter its server needs.
        self._in_process = in_process
        self._busy_poll = BusyPoll(0.0 if in_process else SPIN_S, backoff=True)
        #: A client that reconnects keeps the requests without reply sent since the last reply
        #: came (the server may have died before running them) to send them again; None: it
        #: does not reconnect.
        self._unacked: Optional[List[bytes]] = None

    def _attach(self, sock) -> None:
        """Use ``sock`` (connected, non-blocking for good: replies are polled for, spin then
        poll(2) with the deadline, with no per-call timeout or blocking-mode syscalls)."""
        poller = select.poll()
        poller.register(sock.fileno(), _POLLIN)
        self._poller = poller
        self._sock = sock
        self._recv_probe = partial(sock.recv, _RECV_SIZE)
        self._rbuf = bytearray()
        self._broken = None

    def _fail(self, text: str) -> DistNetworkError:
        self._broken = text
        return DistNetworkError(text)

    def _lost(self, text: str) -> ConnectionLost:
        self._broken = text
        return ConnectionLost(text)

    def _send(self, data: bytes) -> None:
        if self._broken is not None:  # (a client that reconnects tries again: client.py)
            raise (DistNetworkError if self._unacked is None else ConnectionLost)(self._broken)
        if self._unconfirmed is not None:
            self._read_confirmation()
        try:
            sent = self._sock.send(data)
        except BlockingIOError:
            sent = 0
        except OSError as exc:
            raise self._lost(f"Failed to send to {self.describe()}: {exc.strerror or exc}") from exc
        if sent < len(data):
            self._send_rest(memoryview(data)[sent:])

    def _send_unanswered(self, data: bytes, what: str) -> None:
        """Send a request the server does not answer (``what``: SET, APPEND, MULTI_SET,
        QUEUE_PUSH); an in-process client sends a PING after it, whose echo ``_send`` reads
        before the next request (the module docstring, "in-process clients"). A reconnecting
        client keeps it until a reply shows that the server ran it (``_unacked``)."""
        unacked = self._unacked
        if unacked is not None:
            unacked.append(data)
            self._send(data)
            if len(unacked) >= MAX_UNACKED:  # a long stream of sets: confirm them, keep memory bounded
                self._send(codec.ping(CONFIRM_NONCE))
                self._read(4, f"PING after {len(unacked)} requests without reply")
            return
        if not self._in_process:
            self._send(data)
            return
        if len(data) <= _CONFIRM_JOIN_MAX:
            self._send(data + _CONFIRM_REQUEST)
        else:
            self._send(data)
            self._send(_CONFIRM_REQUEST)
        self._unconfirmed = what

    def _read_confirmation(self) -> None:
        """Read the echo of the PING that followed an in-process client's last request
        without reply: the server has then read that request, and everything that reached
        it before the request, and run them."""
        what = f"PING after {self._unconfirmed}"
        self._unconfirmed = None
        echo = U32.unpack(self._read(4, what))[0]
        if echo != CONFIRM_NONCE:
            raise self._fail(f"{self.describe()} answered {what} with {echo:#x} instead of its nonce "
                             f"{CONFIRM_NONCE:#x}; the connection is no longer usable")

    def _send_rest(self, data: memoryview) -> None:
        """The kernel took part of a request (a large value, or a server that reads slowly):
        send the rest as the socket drains, giving up after the reply deadline."""
        limit = self._reply_deadline()
        deadline = time.monotonic() + limit
        poller = select.poll()
        poller.register(self._sock.fileno(), _POLLOUT)
        while data:
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._fail(
                    f"{self.describe()} did not take a request within {format_duration(limit)} "
                    f"({self._what_ran_out()}); the connection is no longer usable")
            poller.poll(max(1, int(left * 1000)))
            try:
                sent = self._sock.send(data)
            except BlockingIOError:
                continue
            except OSError as exc:
                raise self._lost(f"Failed to send to {self.describe()}: {exc.strerror or exc}") from exc
            data = data[sent:]

    def _recv(self, what: str, timeout: Optional[float]) -> None:
        """Append at least one byte to the read buffer; _WaitTimedOut after ``timeout``
        (None: a reply that must come at once, given max(store timeout, 30 s)).

        Busy-polling first (distlib/busy_poll.py): read the socket without sleeping for up
        to ``SPIN_S``. On a VM whose idle vCPUs halt, a blocking read costs a ~100 us
        wake-up per round trip; a reply from a healthy server on the same host or LAN
        arrives well within the window. Spinning yields while more tasks are runnable than
        there are CPUs, and backs off in time while replies keep missing the window (an
        overloaded server). A WAIT's reply (``timeout`` given) comes when another client
        acts: missing the window then says nothing about the server, and is not counted.
        """
        chunk = None
        if timeout != 0:
            assert self._recv_probe is not None, "set with the socket (_attach)"
            try:
                chunk = self._busy_poll.spin(self._recv_probe, timeout is None)
            except OSError as exc:
                raise self._lost(f"Failed to recv from {self.describe()} during {what}: {exc.strerror or exc}") from exc
        if chunk is None:
            chunk = self._recv_blocking(what, timeout)
        if not chunk:
            raise self._lost(f"{_CLOSED_TEXT} ({self.describe()}, during {what})")
        self._rbuf += chunk
        if self._unacked:  # a reply: the server ran every request sent before it
            self._unacked.clear()

    def _recv_blocking(self, what: str, timeout: Optional[float]) -> bytes:
        """Block in poll(2) until the socket has data or the deadline passes; read it."""
        limit = self._reply_deadline() if timeout is None else timeout
        deadline = time.monotonic() + limit
        assert self._poller is not None, "set with the socket (_attach)"
        poll = self._poller.poll
        recv = self._sock.recv
        left = limit
        while True:
            if left > 0:
                # poll(2) counts whole milliseconds: round up, so a wait never ends early
                poll(int(left * 1000) + 1)
            try:
                return recv(_RECV_SIZE)
            except BlockingIOError:
                pass
            except OSError as exc:
                raise self._lost(f"Failed to recv from {self.describe()} during {what}: {exc.strerror or exc}") from exc
            left = deadline - time.monotonic()
            if left > 0:
                continue
            if timeout is not None:
                raise WaitTimedOut()
            raise self._fail(
                f"{self.describe()} did not answer {what} within {format_duration(limit)} "
                f"({self._what_ran_out()}); the connection is no longer usable")

    def _reply_deadline(self) -> float:
        """How long a reply that must come at once may take: max(store timeout, MIN_REPLY_DEADLINE)."""
        return max(self._timeout_s, MIN_REPLY_DEADLINE)

    def _what_ran_out(self) -> str:
        """Which of the two made ``_reply_deadline``, for the error."""
        if self._timeout_s >= MIN_REPLY_DEADLINE:
            return "the store timeout"
        return (f"the reply deadline: {format_duration(MIN_REPLY_DEADLINE)} at least, longer than the store timeout "
                f"of {format_duration(self._timeout_s)}")

    def _read(self, n: int, what: str, timeout: Optional[float] = None) -> bytes:
        buf = self._rbuf
        while len(buf) < n:
            self._recv(what, timeout)
            timeout = None  # once the reply has started, the rest follows at once
        out = bytes(buf[:n])
        del buf[:n]
        return out

    def _read_u8(self, what: str, timeout: Optional[float] = None) -> int:
        buf = self._rbuf
        if not buf:
            self._recv(what, timeout)
        value = buf[0]
        del buf[:1]
        return value

    def _read_i64(self, what: str) -> int:
        buf = self._rbuf
        while len(buf) < 8:
            self._recv(what, None)
        value = _i64(buf)[0]
        del buf[:8]
        return value

    def _read_blob(self, what: str) -> bytes:
        buf = self._rbuf
        while len(buf) < 8:
            self._recv(what, None)
        end = 8 + _u64(buf)[0]
        while len(buf) < end:
            self._recv(what, None)
        value = bytes(buf[8:end])
        del buf[:end]
        return value

    def _await_wait(self, seconds: float, what: str, held_reply: Optional[Callable[[], object]] = None):
        """Read the deferred STOP_WAITING of a WAIT/BARRIER sent with a ``seconds`` limit.

        Returns ``(True, held)`` when the wait completed (``held`` = the reply of the request
        pipelined behind it, if any) and ``(False, None)`` when it timed out and was cancelled.
        On timeout it sends CANCEL_WAIT and reads torch's two-byte race: ``01`` (cancelled),
        or ``00 01`` (the wait completed just before the cancel arrived; then it counts as
        completed). Against a distlib server, the pipelined request's reply comes between.
        """
        buf = self._rbuf
        if not buf:
            try:
                self._recv(what, seconds)
            except WaitTimedOut:
                return self._cancel_timed_out_wait(what, held_reply)
        code = buf[0]
        del buf[:1]
        if code != STOP_WAITING:
            raise self._fail(f"Stop_waiting response is expected (got {code})")
        return True, held_reply() if held_reply else None

    def _cancel_timed_out_wait(self, what: str, held_reply: Optional[Callable[[], object]]):
        """The wait's time is up: CANCEL_WAIT, then torch's two-byte race (_await_wait)."""
        self._send(codec.cancel_wait())
        code = self._read_u8(f"CANCEL_WAIT after {what}")
        if code == STOP_WAITING:
            held = held_reply() if held_reply else None
            if self._read_u8(f"CANCEL_WAIT after {what}") != WAIT_CANCELED:
                raise self._fail("wait_canceled response is expected")
            return True, held
        if code != WAIT_CANCELED:
            raise self._fail(f"wait_canceled response is expected (got {code})")
        if held_reply:
            held_reply()
        return False, None
