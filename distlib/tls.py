"""TLS for the store's connections: the contexts, a non-blocking TLS socket with a plain
socket's contract, and errors that name the check that failed.

Why a module of its own: the store's server (an epoll loop over non-blocking sockets) and its
client (a non-blocking socket it polls) are written against plain sockets. ``TlsSocket``
gives a TLS connection exactly that contract (``recv`` raises BlockingIOError when nothing can
be read, a short read means the socket is drained, ``send`` returns how many bytes it took), so
neither needs a second code path. Only distlib speaks TLS here: torch's TCPStore has no TLS,
so a torch process can never join a store that requires it (docs/security.md).

Choices, and why:

* **TLS 1.3 only.** Both ends are distlib (Python's ssl on OpenSSL >= 1.1.1); 1.3 has no
  renegotiation, so a write never has to wait for a read, and no weak cipher suites to turn
  off.
* **The server is verified, the client is not (by TLS).** Clients check the server's
  certificate against ``DISTLIB_TLS_CA`` and its name against the host they connect to (a
  ``MASTER_ADDR`` that is an IP address needs that IP in the certificate's subjectAltName).
  Clients prove themselves with the token (distlib/auth.py), inside TLS; client
  certificates are not used.
* **A write that would block is retried with the same bytes.** OpenSSL requires it after
  SSL_write reports WANT_WRITE; ``TlsSocket.send`` keeps that chunk and sends it again,
  whatever it is called with next, and callers (which always retry with the same unsent
  bytes, as with a plain socket) see an ordinary partial send.
"""

from __future__ import annotations

import errno
import ssl
from typing import Optional, Sequence

#: The most one ``send`` hands to OpenSSL (it encrypts it into 16 KiB records).
MAX_WRITE = 256 * 1024

#: A TLS record's first byte for a handshake message (a ClientHello starts with it).
HANDSHAKE_RECORD = 0x16
#: A fatal TLS alert, "protocol_version" (70), in a TLS 1.2 record: what a TLS-only server sends
#: to a client that speaks plaintext. A distlib client recognises it (``is_tls_record``); a torch
#: client reads its first 4 bytes as its PING's echo and fails at once ("Ping failed").
PLAINTEXT_REFUSAL = bytes([0x15, 0x03, 0x03, 0x00, 0x02, 0x02, 70])

_WOULD_BLOCK = (ssl.SSLWantReadError, ssl.SSLWantWriteError)


def is_tls_record(data: bytes) -> bool:
    """Whether ``data`` (at least 2 bytes) starts like a TLS record (alert or handshake)."""
    return len(data) >= 2 and data[0] in (0x15, HANDSHAKE_RECORD) and data[1] == 0x03


def _load_error(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror and not isinstance(exc, ssl.SSLError):
        return exc.strerror
    reason = getattr(exc, "reason", None)
    if reason == "KEY_VALUES_MISMATCH":
        return "the key does not belong to the certificate"
    return str(reason or exc)


def server_context(cert: str, key: str, cert_source: str = "DISTLIB_TLS_CERT",
                   key_source: str = "DISTLIB_TLS_KEY") -> ssl.SSLContext:
    """The server's context: its certificate chain and key (PEM files). ValueError naming the
    setting and the file when one is missing, unreadable, or the pair does not match."""
    if bool(cert) != bool(key):
        missing = key_source if cert else cert_source
        raise ValueError(f"TLS needs a certificate and its key: {missing} is not set")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    try:
        ctx.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"cannot load the TLS certificate {cert_source}={cert} with its key {key_source}={key}: "
                         f"{_load_error(exc)}") from None
    return ctx


def client_context(ca: str, source: str = "DISTLIB_TLS_CA") -> ssl.SSLContext:
    """A client's context: servers must present a certificate signed by the CA in ``ca`` (PEM),
    for the name the client connects to."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # check_hostname and CERT_REQUIRED
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    try:
        ctx.load_verify_locations(cafile=ca)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"cannot load the TLS CA {source}={ca}: {_load_error(exc)}") from None
    return ctx


def describe_failure(exc: BaseException) -> str:
    """The check a failed TLS handshake stopped at, in a user's words."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        message = exc.verify_message or str(exc)
        if "mismatch" in message:
            return f"its certificate is not for this name ({message})"
        if "expired" in message or "not yet valid" in message:
            return f"its certificate is outside its validity dates ({message})"
        if "issuer" in message or "self-signed" in message or "self signed" in message:
            return f"its certificate is not signed by DISTLIB_TLS_CA ({message})"
        return f"its certificate failed verification ({message})"
    if isinstance(exc, (ssl.SSLEOFError, ConnectionResetError, BrokenPipeError)):
        return "the server closed the connection during the TLS handshake"
    reason = getattr(exc, "reason", None)
    if reason == "WRONG_VERSION_NUMBER":
        return "the server does not speak TLS (it answered in plaintext)"
    if reason and "PROTOCOL_VERSION" in reason:
        return "the server does not accept TLS 1.3"
    return f"{type(exc).__name__}: {reason or exc}"


#: What a client's TLS alert tells the server, by OpenSSL's reason code.
_CLIENT_ALERTS = {
    "TLSV1_ALERT_UNKNOWN_CA": "the client does not trust this server's certificate (not signed by its CA)",
    "SSLV3_ALERT_BAD_CERTIFICATE": "the client rejected this server's certificate (not for the name it connects "
                                   "to?)",
    "SSLV3_ALERT_CERTIFICATE_EXPIRED": "the client says this server's certificate is outside its validity dates",
    "TLSV1_ALERT_PROTOCOL_VERSION": "the client does not speak TLS 1.3",
    "UNSUPPORTED_PROTOCOL": "the client does not speak TLS 1.3",
}


def describe_client_failure(exc: BaseException) -> str:
    """Why a server's TLS handshake with a client failed, in a user's words."""
    reason = getattr(exc, "reason", None)
    meaning = _CLIENT_ALERTS.get(reason or "")
    return f"{meaning} ({reason})" if meaning else f"{type(exc).__name__}: {reason or exc}"


class TlsSocket:
    """A connected, non-blocking ``ssl.SSLSocket`` behind a plain socket's contract.

    * ``recv(size)`` returns what it could read, b"" at the end, and raises BlockingIOError
      when there is nothing. It never leaves decrypted bytes inside OpenSSL (it may return a
      little more than ``size`` for that), so poll(2) never sleeps on buffered data. With
      ``drain`` (the server's edge-triggered loop) it also reads on until the socket is
      drained or ``size`` bytes came, so that, as with a plain socket, a read shorter than
      ``size`` means "wait for the next readable event"; without (a client that polls
      level-triggered) it saves that last, failing read.
    * ``send(data)`` / ``sendmsg(buffers)`` return how many bytes of the front of the data
      they took (at most MAX_WRITE) or raise BlockingIOError; see the module docstring for
      the bytes kept for the retry.

    Every other attribute (``fileno``, ``close``, ``getpeername``, ``family`` ...) is the
    SSLSocket's.
    """

    __slots__ = ("ssl", "_retry", "_drain")

    def __init__(self, sock: ssl.SSLSocket, drain: bool = True):
        self.ssl = sock
        self._retry: Optional[memoryview] = None
        self._drain = drain

    def __getattr__(self, name):
        return getattr(self.ssl, name)

    def recv(self, size: int) -> bytes:
        sock = self.ssl
        try:
            data = sock.recv(size)
        except _WOULD_BLOCK:
            raise BlockingIOError(errno.EAGAIN, "no TLS record to read") from None
        except ssl.SSLZeroReturnError:
            return b""
        if not data:
            return data
        n = len(data)
        parts = None
        drain = self._drain
        while (drain and n < size) or sock.pending():
            try:
                more = sock.recv(max(size - n, sock.pending(), 1))
            except _WOULD_BLOCK:
                break
            except ssl.SSLZeroReturnError:
                break
            if not more:
                break
            if parts is None:
                parts = [data]
            parts.append(more)
            n += len(more)
        return data if parts is None else b"".join(parts)

    def send(self, data) -> int:
        chunk = self._retry
        if chunk is None:
            chunk = memoryview(data)[:MAX_WRITE]
        try:
            sent = self.ssl.send(chunk)
        except _WOULD_BLOCK:
            self._retry = chunk
            raise BlockingIOError(errno.EAGAIN, "TLS write would block") from None
        self._retry = None
        return sent

    def sendmsg(self, buffers: Sequence) -> int:
        if self._retry is not None or len(buffers) == 1:
            return self.send(buffers[0] if self._retry is None else self._retry)
        joined = bytearray()
        for part in buffers:
            joined += part[: MAX_WRITE - len(joined)]
            if len(joined) >= MAX_WRITE:
                break
        return self.send(joined)

    def sendall(self, data) -> None:
        """Blocking send of everything (the client's handshake, with the socket's timeout)."""
        self.ssl.sendall(data)
