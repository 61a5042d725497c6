"""A client's way into a store server: the transport, TLS, the token, the TCPStore handshake.

``open_connection`` returns a connected socket that has passed every step the server and the
client's settings (``StoreSecurity``) ask for, retrying what may succeed later (nobody
listening yet, a handshake cut short) until the deadline, and failing at once, with a
DistStoreError that says what to change, on what will not:

* **Transport.** A loopback host reaches a distlib server over its same-host UNIX socket when
  one is there and is held by this user (``net.same_user``: an abstract socket name has no
  permissions, and another user may have taken it first); otherwise TCP (connect.py).
* **TLS** (TCP, when ``DISTLIB_TLS_CA`` is set): the server's certificate must chain to the
  CA and name the host. A failed check names the check (distlib/tls.py).
* **The token** (when set): the server speaks first, with its challenge; the client answers
  and sends its TCPStore handshake in the same write, then checks the server's proof. A
  server that sends no challenge within CHALLENGE_PATIENCE_S is asked the TCPStore handshake:
  if it answers, it is a store without the token, which this client refuses (it cannot prove
  it holds the token); if a challenge comes after all (a slow server), the client connects
  again and waits longer. A client without the token that meets a challenge says the store
  requires one.
* **The TCPStore handshake**: VALIDATE, PING with the pid (its echo must match), and the
  ordered-wait probe (codec.py).

A peer that accepts and then says nothing is named as what it most likely is, another
service on the port: a warning after SILENT_WARN_S, the error at the deadline.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import ssl
import time
from typing import Optional, Set

from ... import auth, tls
from ...deadline import Deadline, format_duration
from ...errors import DistNetworkError, DistStoreError
from ...net import same_user, unix_socket_name
from .codec import ORDERED_WAIT_PROBE_KEY, READY, U32, Op, keys_request, ping, validate
from .connect import connect, format_endpoint, resolve
from .security import StoreSecurity

log = logging.getLogger("distlib.store.tcp.handshake")

#: A client with the token waits this long for the server's challenge before it asks whether
#: the server is a store without the token (see the module docstring).
CHALLENGE_PATIENCE_S = 1.0
#: A peer that has answered nothing this long is worth a warning (the error comes at the deadline).
SILENT_WARN_S = 5.0

CLOSED_TEXT = ("Failed to recv, got 0 bytes. Connection was likely closed. "
               "Did the remote server shutdown or crash?")

_warned_sockets: Set[int] = set()  # ports whose same-host socket another user holds (warned once)


class NotAStoreServer(DistNetworkError):
    """The peer answered the handshake wrongly: retrying will not help."""


class StoreRefused(DistStoreError):
    """The store and this client cannot agree (token, TLS): retrying will not help."""


class _Slow(Exception):
    """Internal: the challenge came after this client had given up on it; connect again."""


class _Silent(Exception):
    """Internal: the peer said nothing until the deadline (``what`` it did not answer)."""

    def __init__(self, what: str, waited: float):
        super().__init__(what)
        self.what, self.waited = what, waited


class Opened:
    """A connection that passed every step: its socket (blocking, with a timeout), whether the
    server runs requests in order (``ordered``), and the loopback address a same-host socket
    stands for (``local_ip``, None over TCP)."""

    __slots__ = ("sock", "ordered", "local_ip", "tls")

    def __init__(self, sock, ordered: bool, local_ip: Optional[str], tls_on: bool):
        self.sock, self.ordered, self.local_ip, self.tls = sock, ordered, local_ip, tls_on


def open_connection(host: str, port: int, deadline: Deadline, security: StoreSecurity,
                    quiet: bool = False) -> Opened:
    """Connect and pass every step, retrying what may succeed later until ``deadline``
    (``quiet``: without logging the retries)."""
    where = format_endpoint(host, port)
    patient = False  # after a challenge that came late: wait for it without asking
    attempts = 0
    failed: Optional[BaseException] = None  # what ended the last attempt that failed
    while True:
        attempts += 1
        local_ip = _loopback_ip(host, port)
        sock = _connect_local(port, deadline) if local_ip is not None else None
        if sock is None:
            local_ip = None
            sock = connect(host, port, deadline, quiet=quiet)  # (its own error at the deadline)
        try:
            if local_ip is None and security.client_tls is not None:
                sock = _tls_handshake(sock, host, where, deadline, security)
            ordered = _handshake(sock, where, deadline, security.token, patient)
            return Opened(sock, ordered, local_ip, isinstance(sock, ssl.SSLSocket))
        except _Silent as exc:
            _close(sock)
            if failed is not None:  # silent for what was left of the timeout, after attempts that failed
                raise DistNetworkError(
                    f"The client socket has timed out after {int(deadline.seconds * 1000)}ms while trying to connect "
                    f"to ({host}, {port}): connected {attempts} times, but the handshake failed: {failed}; the last "
                    f"attempt got no answer to {exc.what} in the {format_duration(exc.waited)} that was left") from None
            raise NotAStoreServer(
                f"The client socket has timed out after {int(deadline.seconds * 1000)}ms while trying to connect to "
                f"({host}, {port}): {where} accepted the connection but did not answer {exc.what} within "
                f"{format_duration(exc.waited)}: is another service on this port?") from None
        except (NotAStoreServer, StoreRefused):
            _close(sock)
            raise
        except _Slow:
            _close(sock)
            patient = True
            log.info("%s sent its authentication challenge late: connecting again", where)
        except (OSError, DistNetworkError) as exc:
            _close(sock)
            failed = exc
            if deadline.expired():
                closed = isinstance(exc, (ConnectionResetError, BrokenPipeError))  # (closed as we sent)
                raise DistNetworkError(
                    f"The client socket has timed out after {int(deadline.seconds * 1000)}ms while trying "
                    f"to connect to ({host}, {port}): connected, but the handshake failed: {exc}"
                    f"{_closed_hint(b'') if closed else ''}") from exc
            time.sleep(min(0.05, deadline.remaining()))


def _close(sock) -> None:
    if sock is None:
        return
    try:
        sock.close()
    except OSError:
        pass


# -- the transport ------------------------------------------------------------------------------


def _loopback_ip(host: str, port: int) -> Optional[str]:
    """The loopback address ``host`` stands for when the same-host socket may be tried, else None.

    Only IP literals and ``localhost`` qualify: any other name would cost a second name
    lookup before every connect (and a slow resolver would delay remote clients).
    """
    from ... import settings

    if not settings.store_unix_socket():
        return None
    name = host.strip("[]")
    try:
        ip = ipaddress.ip_address(name.split("%")[0])
    except ValueError:
        if name.lower() != "localhost":
            return None
        try:
            addresses = [info[3][0] for info in resolve(host, port)]
            ips = [ipaddress.ip_address(a.split("%")[0]) for a in addresses]
        except (OSError, UnicodeError, ValueError):
            return None
        return addresses[0] if ips and all(_is_loopback(i) for i in ips) else None
    return name if _is_loopback(ip) else None


def _is_loopback(ip) -> bool:
    mapped = getattr(ip, "ipv4_mapped", None)  # ::ffff:127.0.0.1
    return (mapped or ip).is_loopback


def _connect_local(port: int, deadline: Deadline) -> Optional[socket.socket]:
    """The server's same-host socket, if it is there and held by this user; else None (TCP).

    Same protocol, same handshake, same server; only the kernel's path differs (a UNIX
    socket costs about a third of TCP loopback per request). torch servers have no such
    socket, so against them nothing changes; DISTLIB_STORE_UNIX=0 turns it off.
    """
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(max(0.001, min(1.0, deadline.remaining())))
        sock.connect(unix_socket_name(port))
    except OSError:
        sock.close()
        return None
    stranger = same_user(sock)
    if stranger is not None:
        sock.close()
        if port not in _warned_sockets:
            _warned_sockets.add(port)
            log.warning("the same-host socket @%s is held by %s, not by a store server of this user: "
                        "not using it; connecting over TCP", unix_socket_name(port)[1:].decode(), stranger)
        return None
    return sock


def _tls_handshake(sock: socket.socket, host: str, where: str, deadline: Deadline,
                   security: StoreSecurity):
    """TLS over a connected TCP socket: the server must prove the name ``host`` with a
    certificate the CA signed. StoreRefused naming the check that failed."""
    assert security.client_tls is not None, "called only with TLS"
    wrapped = security.client_tls.wrap_socket(sock, server_hostname=host.strip("[]"),
                                              do_handshake_on_connect=False)
    try:
        _Talk(wrapped, deadline, where).run("the TLS handshake", wrapped.do_handshake)
    except _Silent:
        _close(wrapped)
        raise
    except ssl.SSLError as exc:
        _close(wrapped)
        hint = ""
        if isinstance(exc, ssl.SSLEOFError) or getattr(exc, "reason", None) == "WRONG_VERSION_NUMBER":
            hint = ": does it serve TLS (started with --tls-cert/--tls-key, or DISTLIB_TLS_CERT/DISTLIB_TLS_KEY)?"
        raise StoreRefused(f"TLS to the store at {where} failed: {tls.describe_failure(exc)}{hint} "
                           f"(checked with {security.source('ca')}={security.ca})") from None
    except OSError as exc:
        _close(wrapped)
        if isinstance(exc, (ConnectionResetError, BrokenPipeError)):
            raise StoreRefused(f"TLS to the store at {where} failed: the server closed the connection during the "
                               f"TLS handshake: does it serve TLS (started with --tls-cert/--tls-key)?") from None
        raise
    return wrapped


# -- the handshake ------------------------------------------------------------------------------


class _Talk:
    """The blocking exchange with one freshly connected peer, under the connect deadline.

    Silence is counted from the connect, across the steps: a warning once it lasts
    SILENT_WARN_S, and _Silent at the deadline (which the caller words as another service).
    """

    __slots__ = ("sock", "deadline", "where", "start", "warned")

    def __init__(self, sock, deadline: Deadline, where: str):
        self.sock, self.deadline, self.where = sock, deadline, where
        self.start = time.monotonic()
        self.warned = False

    def run(self, what: str, step, patience: Optional[float] = None):
        """``step()`` (a blocking call on the socket) until it returns; None if ``patience``
        seconds pass first."""
        begun = time.monotonic()
        while True:
            now = time.monotonic()
            limit = self.deadline.remaining()
            if patience is not None:
                limit = min(limit, patience - (now - begun))
            if not self.warned:
                limit = min(limit, SILENT_WARN_S - (now - self.start))
            self.sock.settimeout(max(0.001, limit))
            try:
                return step()
            except (socket.timeout, ssl.SSLWantReadError):
                pass
            now = time.monotonic()
            if patience is not None and now - begun >= patience - 1e-3:
                return None
            if self.deadline.expired():
                raise _Silent(what, now - self.start)
            if not self.warned and now - self.start >= SILENT_WARN_S - 1e-3:
                self.warned = True
                log.warning("%s accepted the connection but has not answered %s for %s: is another service on "
                            "this port? (waiting %s more)", self.where, what, format_duration(now - self.start),
                            format_duration(self.deadline.remaining()))

    def recv_exact(self, n: int, what: str, patience: Optional[float] = None, got: bytes = b""):
        """``n`` bytes (with ``got`` first); None if ``patience`` ran out with nothing new."""
        buf = bytearray(got)
        sock = self.sock
        while len(buf) < n:
            try:
                chunk = self.run(what, lambda: sock.recv(n - len(buf)), patience)  # noqa: B023 - run() calls it now
            except ConnectionResetError:
                chunk = b""  # closed with our bytes unread: a refusal too, said the same way
            if chunk is None:
                return None
            if not chunk:
                raise DistNetworkError(f"{CLOSED_TEXT} (during {what} with {self.where}"
                                       f"{'' if not buf else f', after {bytes(buf)!r}'}){_closed_hint(bytes(buf))}")
            buf += chunk
            patience = None  # once it has started, the rest follows
        return bytes(buf)


def _closed_hint(got: bytes) -> str:
    return "" if got else (": a store that requires TLS or authentication closes connections that do not "
                           "(DISTLIB_TLS_CA, DISTLIB_AUTH_TOKEN), and a distlib store closes those over its "
                           "connection limits (the store's log names the limit)")


def _handshake(sock, where: str, deadline: Deadline, token: Optional[bytes], patient: bool) -> bool:
    """The token's exchange (if any) and the TCPStore handshake; whether the server runs each
    connection's requests in order (a distlib server)."""
    nonce = os.getpid() & 0xFFFFFFFF
    hello = validate() + ping(nonce) + keys_request(Op.CHECK, [ORDERED_WAIT_PROBE_KEY])
    talk = _Talk(sock, deadline, where)
    if token is not None:
        return _authenticated_handshake(talk, token, patient, nonce, hello)
    sock.sendall(hello)
    return _check_echo(talk.recv_exact(5, "the TCPStore handshake"), nonce, where)


def _check_echo(reply: bytes, nonce: int, where: str) -> bool:
    echoed = U32.unpack_from(reply)[0]
    if echoed == nonce:
        return reply[4] == READY
    if auth.is_challenge_start(reply):
        raise StoreRefused(f"the store at {where} requires authentication: set DISTLIB_AUTH_TOKEN "
                           f"(or DISTLIB_AUTH_TOKEN_FILE) to the store's token")
    if tls.is_tls_record(reply):
        raise StoreRefused(f"the store at {where} requires TLS: set DISTLIB_TLS_CA to the CA that signed its "
                           f"certificate")
    raise NotAStoreServer(
        f"Ping failed, invalid value returned from server. Expected: {nonce}, Got: {echoed} "
        f"({where} answered, but not as a TCPStore server: is this the right port?)")


def _authenticated_handshake(talk: _Talk, token: bytes, patient: bool, nonce: int, hello: bytes) -> bool:
    where = talk.where
    challenge = talk.recv_exact(auth.CHALLENGE_BYTES, "the authentication challenge",
                                None if patient else CHALLENGE_PATIENCE_S)
    if challenge is None:  # silent: a store without the token (it waits for VALIDATE), or slow
        return _ask_silent_server(talk, nonce)
    if not challenge.startswith(auth.MAGIC):
        raise NotAStoreServer(f"{where} spoke first, but not with an authentication challenge (first bytes: "
                              f"{challenge[:16]!r}): is another service on this port?")
    response, peer_nonce, listener_nonce = auth.respond(token, challenge)
    talk.sock.sendall(response + hello)
    first = talk.recv_exact(1, "the authentication verdict")
    if first[0] == auth.REFUSED:
        raise StoreRefused(f"authentication to {where} failed: wrong token (this DISTLIB_AUTH_TOKEN is not the "
                           f"store's)")
    verdict = talk.recv_exact(auth.VERDICT_BYTES, "the authentication verdict", got=first)
    if not auth.verify_verdict(token, peer_nonce, listener_nonce, verdict):
        raise StoreRefused(f"the store at {where} accepted this client but could not prove that it holds "
                           f"DISTLIB_AUTH_TOKEN: it is not the store it claims to be")
    return _check_echo(talk.recv_exact(5, "the TCPStore handshake"), nonce, where)


def _ask_silent_server(talk: _Talk, nonce: int) -> bool:
    """No challenge within CHALLENGE_PATIENCE_S: send the TCPStore handshake and see who answers."""
    where = talk.where
    talk.sock.sendall(validate() + ping(nonce))
    first = talk.recv_exact(4, "an authentication challenge or the TCPStore handshake")
    if U32.unpack_from(first)[0] == nonce:
        raise StoreRefused(f"the store at {where} does not ask for authentication, but DISTLIB_AUTH_TOKEN is set "
                           f"here: it was started without the token (or it is a torch store, which cannot "
                           f"authenticate); this client uses only a store that proves it holds the token")
    if auth.is_challenge_start(first):
        raise _Slow()
    return _check_echo(first + b"\x00", nonce, where)  # raises: a TLS alert, or not a store
