"""Connecting a TCPStore client, and coming back when its connection drops
(``ReconnectingChannel``, the base of ``TCPStore`` in client.py).

Why a client reconnects: a master service that restarts (a pod rescheduled, the process
OOM-killed and restarted) should not end the jobs that use it. A client of a distlib server
(not one on a thread of this process: that server cannot come back) retries within
``reconnect_timeout`` (default DISTLIB_STORE_RECONNECT_TIMEOUT, else the store timeout; 0:
fail at once, as torch's client): the same address, the name resolved again, TLS and the
token again, one log line when it starts and one when it is back. It sends again what the
server may not have run. Writes a retry must not apply twice carry a sequence header
(sequence.py), so the server answers a repeated one without applying it again.

The server it comes back to must hold the keys the job wrote: the client asked the server's
incarnation when it first connected (incarnation.py; one round trip, busy-polled for like any
reply: a blocking read would pay the VM's wake-up) and compares it; a server that came
back empty (no state directory, or a new one) is a new incarnation, and the client fails at
once naming it instead of waiting out its timeout for keys that are gone.
"""

from __future__ import annotations

import logging
import os
import weakref
from typing import Optional

from ...deadline import Deadline, format_duration
from ...errors import DistNetworkError, DistStoreError
from ...tls import TlsSocket
from . import codec
from .client_channel import ConnectionLost, RequestChannel, close_socket
from .connect import format_endpoint
from .handshake import NotAStoreServer, StoreRefused, open_connection
from .incarnation import INCARNATION_KEY, describe
from .security import StoreSecurity
from .sequence import sequence_header

log = logging.getLogger("distlib.store.tcp.client")

_ASK_INCARNATION = codec.get(INCARNATION_KEY)


class StoreStateLost(DistStoreError):
    """The store came back after a restart without the keys it held (a new incarnation):
    resuming would wait for keys that are gone; retrying will not help."""


class ReconnectingChannel(RequestChannel):
    """A RequestChannel that connects (``_connect``) and reconnects (``_resume``).

    TCPStore provides ``_host``, ``_port``, ``_security`` and ``_timeout_s``, calls
    ``_init_reconnecting`` before its first ``_connect`` and sets ``_finalizer`` after it.
    ``_resume`` raises DistNetworkError naming the server when it cannot come back within the
    window, and StoreStateLost when the server came back as a new incarnation (and at once, for
    every call after that one: the keys are not coming back).
    """

    _host: str
    _port: int
    _security: StoreSecurity
    _finalizer: weakref.finalize  # closes the socket; set by TCPStore once connected

    def _init_reconnecting(self, reconnect_s: Optional[float]) -> None:
        self._reconnect_s = reconnect_s  # None: the store timeout, as set when it is needed
        self._local_ip: Optional[str] = None  # set while connected over the same-host socket
        self._ordered = False  # a distlib server (ordered waits, sequence headers, reconnecting)
        self._session = os.urandom(16)  # numbers its writes that a retry must not apply twice
        self._seq = 0
        self._incarnation: Optional[bytes] = None  # the server's, as first seen (incarnation.py)
        self._state_lost: Optional[str] = None  # why: once the server came back as a new state

    # -- connection ------------------------------------------------------------------------------

    def _connect(self, deadline: Deadline, quiet: bool = False) -> None:
        """Connect and pass every step the server and this client's settings ask for (the
        same-host socket or TCP, TLS, the token, the TCPStore handshake: handshake.py). A
        client that will reconnect then asks a distlib server which state it serves
        (``_check_incarnation``)."""
        reconnects = self._reconnect_window() > 0 and not self._in_process
        opened = open_connection(self._host, self._port, deadline, self._security, quiet)
        sock = opened.sock
        self._local_ip = opened.local_ip
        self._ordered = opened.ordered
        sock.setblocking(False)
        if opened.tls:
            sock = TlsSocket(sock, drain=False)  # poll(2) is level-triggered: no read to prove "drained"
        self._attach(sock)
        # A client of a distlib server (not one on a thread of this process: that one cannot
        # come back) reconnects when its connection drops, and numbers its writes.
        if opened.ordered and reconnects:
            self._check_incarnation()
            if self._unacked is None:
                self._unacked = []

    def _check_incarnation(self) -> None:
        """Ask the server's incarnation (a GET of INCARNATION_KEY, through this channel: its reply
        is busy-polled for like any other); remember the first, and raise StoreStateLost when a
        later connection finds another (the server came back as a new state)."""
        # (its reply says nothing of the requests sent on the connection before this one: they
        # stay to be sent again)
        kept, self._unacked = self._unacked, None
        try:
            self._send(_ASK_INCARNATION)
            found = self._read_blob("the question which state it serves")
        finally:
            self._unacked = kept
        if not found:  # (a distlib server older than incarnations: nothing to compare)
            return
        if self._incarnation is not None and found != self._incarnation:
            close_socket(self._sock)
            self._broken = "the store came back as a new state"  # (no request goes to it: _resume says why)
            raise StoreStateLost(
                f"the store {format_endpoint(self._host, self._port)} came back without the keys it held: it "
                f"serves a new state (incarnation {describe(found)}, was {describe(self._incarnation)}): it "
                f"was restarted without --state-dir, or with another state directory, so the keys this job "
                f"wrote are gone and waiting for them would only run out the timeout; restart the job, and "
                f"give the master service a --state-dir on storage that outlives it to ride out its restarts "
                f"(docs/stores.md)")
        self._incarnation = found

    # -- reconnecting ----------------------------------------------------------------------------

    def _reconnect_window(self) -> float:
        """How long to reconnect: ``reconnect_timeout``, else the store timeout (as set now)."""
        return self._timeout_s if self._reconnect_s is None else self._reconnect_s

    def _numbered(self, data: bytes) -> bytes:
        """``data`` (a write a retry must not apply twice) behind its sequence header, for a
        client that reconnects; else ``data`` as it is (a torch server, or reconnect off)."""
        if self._unacked is None:
            return data
        self._seq += 1
        return sequence_header(self._session, self._seq) + data

    def _resume(self, lost: DistNetworkError, what: str, data: bytes = b"", read=None):
        """The connection dropped under ``what``: reconnect (same address, the name resolved
        again, TLS and the token again) within ``reconnect_timeout``, send again the requests
        without reply the server may not have run and ``data`` (a numbered write keeps its
        number: the server answers it without applying it twice), and return ``read()``.
        Logs one line when it starts and one when it is back. Raises ``lost`` itself for a
        client that does not reconnect (a torch server, ``reconnect_timeout=0``)."""
        if self._unacked is None:
            raise lost
        where = format_endpoint(self._host, self._port)
        if self._state_lost is not None:  # known already: fail at once, without retrying or a new line
            raise StoreStateLost(f"{what} not sent: {self._state_lost}") from lost
        window = self._reconnect_window()
        deadline = Deadline(window)
        log.warning("lost the connection to the store %s during %s (%s); reconnecting for at most %s",
                    where, what, lost, format_duration(window))
        closed = 0
        while True:
            self._finalizer()
            try:
                self._connect(deadline, quiet=True)
            except StoreStateLost as exc:
                self._state_lost = f"lost the connection to the store {where} during {what}, and {exc}"
                raise StoreStateLost(self._state_lost) from lost
            except DistNetworkError as exc:
                if isinstance(exc, (NotAStoreServer, StoreRefused)):
                    raise
                if isinstance(exc, ConnectionLost) and not deadline.expired():
                    continue  # dropped again before it said which state it serves: the window is not over
                raise DistNetworkError(f"lost the connection to the store {where} during {what} and could not "
                                       f"reconnect within {format_duration(window)} (reconnect_timeout): {exc}") from lost
            finally:
                self._finalizer = weakref.finalize(self, close_socket, self._sock)
            if not self._ordered:
                raise DistNetworkError(f"lost the connection to the store {where} during {what}; it came back as a "
                                       f"server that cannot tell a re-sent write from a new one (a torch server): "
                                       f"not re-sending it") from lost
            try:
                resend = b"".join(self._unacked) + data
                if resend:
                    self._send(resend)
                result = read() if read is not None else None
            except ConnectionLost as again:
                closed += 1
                if closed >= 2:  # not a restart: the server refuses this request
                    raise DistNetworkError(f"{where} closed the connection each time {what} was re-sent after "
                                           f"reconnecting ({closed} times): the server refuses the request (its "
                                           f"log says why)") from again
                if deadline.expired():
                    raise DistNetworkError(f"lost the connection to the store {where} during {what} and could not "
                                           f"get it answered within {format_duration(window)} (reconnect_timeout): "
                                           f"{again}") from lost
                continue
            log.warning("reconnected to the store %s after %s; %s resumed", where,
                        format_duration(deadline.elapsed()), what)
            return result
