"""Mutual authentication of a connection by a shared token: one challenge-response each way.

Why: anyone who can reach a store or a rank's listener could otherwise write join records or
send pickles that ranks unpickle. With a token (``DISTLIB_AUTH_TOKEN``, or a file named by
``DISTLIB_AUTH_TOKEN_FILE``) every listener proves it holds the token to every connecting
peer and the peer proves it back, before a single request is read. The token never crosses the
wire: each side sends an HMAC-SHA256 over both sides' random nonces.

The exchange (the listener speaks first, so a peer without the token learns at once that one
is required)::

    listener -> peer   CHALLENGE = b"DISTLIB-AUTH/1\\n" (15 bytes) + listener nonce (32 bytes)
    peer -> listener   peer nonce (32) + HMAC(token, b"distlib-auth/1 peer\\0"
                                                     + listener nonce + peer nonce)  (32)
    listener -> peer   ACCEPTED (1 byte, 0x00) + HMAC(token, b"distlib-auth/1 listener\\0"
                                                              + peer nonce + listener nonce) (32)
                       or REFUSED (1 byte, 0x01), then the listener closes

Worked example (token ``b"k" * 16``, listener nonce 32 bytes of 0x01, peer nonce 32 of 0x02):
the peer's MAC begins ``3f d2``, the listener's ``6a 7d`` (tests/test_auth.py checks both).
The two labels differ, so a listener's proof can never be replayed as a peer's.

What it does not do: without TLS the rest of the connection is not protected; an attacker on
the path who can rewrite packets after the exchange is stopped only by TLS (docs/security.md).
With no token set, nothing here runs and the store's wire is byte for byte torch's.

The pure functions build and check messages; ``connect_blocking`` runs a peer's side of the
exchange on a blocking socket with a deadline (a rank connecting to a peer's mesh listener); the
listeners (the store server, a rank's mesh listener: backends/gloo/transport/accept.py) drive the same
functions from their event loops, many connections at once.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
from typing import Mapping, Optional, Tuple

from . import settings

from .deadline import Deadline, format_duration
from .errors import DistNetworkError

MAGIC = b"DISTLIB-AUTH/1\n"
NONCE_BYTES = 32
MAC_BYTES = 32
CHALLENGE_BYTES = len(MAGIC) + NONCE_BYTES
RESPONSE_BYTES = NONCE_BYTES + MAC_BYTES
ACCEPTED = 0
REFUSED = 1
VERDICT_BYTES = 1 + MAC_BYTES  # ACCEPTED + the listener's MAC; a refusal is its first byte only

_PEER_LABEL = b"distlib-auth/1 peer\0"
_LISTENER_LABEL = b"distlib-auth/1 listener\0"

#: Shortest token accepted: an eavesdropper who records one exchange can try tokens offline,
#: so a token must be too long to guess (``openssl rand -hex 32`` gives 64 characters).
MIN_TOKEN_CHARS = 16


class AuthError(DistNetworkError):
    """A peer could not be authenticated (wrong token, no token, or not a distlib peer)."""


def check_token(token: str, source: str) -> bytes:
    """The token as bytes; ValueError naming ``source`` when it is too short to be safe."""
    token = token.strip()
    if len(token) < MIN_TOKEN_CHARS:
        raise ValueError(
            f"{source} holds a token of {len(token)} characters; use at least {MIN_TOKEN_CHARS} random "
            f"characters (e.g. `openssl rand -hex 32`)")
    return token.encode()


def configured_token(env: Optional[Mapping[str, str]] = None) -> Optional[bytes]:
    """The job's token (DISTLIB_AUTH_TOKEN or the file DISTLIB_AUTH_TOKEN_FILE names), or None
    when neither is set. ValueError for a token that is unreadable, ambiguous or too short."""
    found = settings.auth_token(env)
    return None if found is None else check_token(found[1], found[0])


def token_from_file(path: str) -> bytes:
    """The token in the file at ``path`` (``distlib store-server --auth-token-file``)."""
    return check_token(settings.read_token_file(path, "--auth-token-file"), f"--auth-token-file {path}")


def _mac(token: bytes, label: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.new(token, label + first + second, hashlib.sha256).digest()


# -- the messages (pure) --------------------------------------------------------------------------


def challenge(nonce: Optional[bytes] = None) -> Tuple[bytes, bytes]:
    """(message, listener nonce): what a listener sends first."""
    nonce = os.urandom(NONCE_BYTES) if nonce is None else nonce
    return MAGIC + nonce, nonce


def is_challenge_start(data: bytes) -> bool:
    """Whether ``data`` (at least one byte) can be the start of a challenge."""
    n = min(len(data), len(MAGIC))
    return n > 0 and data[:n] == MAGIC[:n]


def respond(token: bytes, message: bytes, nonce: Optional[bytes] = None) -> Tuple[bytes, bytes, bytes]:
    """(response, peer nonce, listener nonce) to a listener's challenge ``message``.

    Raises AuthError when ``message`` is not a challenge.
    """
    if len(message) != CHALLENGE_BYTES or not message.startswith(MAGIC):
        raise AuthError("the listener's first bytes are not a distlib authentication challenge")
    listener_nonce = message[len(MAGIC):]
    nonce = os.urandom(NONCE_BYTES) if nonce is None else nonce
    return nonce + _mac(token, _PEER_LABEL, listener_nonce, nonce), nonce, listener_nonce


def verify_response(token: bytes, listener_nonce: bytes, response: bytes) -> Optional[bytes]:
    """The listener's verdict: ACCEPTED + its own MAC when ``response`` proves the token, else
    None (the caller sends ``bytes([REFUSED])`` and closes)."""
    if len(response) != RESPONSE_BYTES:
        return None
    peer_nonce, mac = response[:NONCE_BYTES], response[NONCE_BYTES:]
    if not hmac.compare_digest(mac, _mac(token, _PEER_LABEL, listener_nonce, peer_nonce)):
        return None
    return bytes([ACCEPTED]) + _mac(token, _LISTENER_LABEL, peer_nonce, listener_nonce)


def verify_verdict(token: bytes, peer_nonce: bytes, listener_nonce: bytes, verdict: bytes) -> bool:
    """Whether the listener accepted and proved that it holds the token too."""
    if len(verdict) != VERDICT_BYTES or verdict[0] != ACCEPTED:
        return False
    return hmac.compare_digest(verdict[1:], _mac(token, _LISTENER_LABEL, peer_nonce, listener_nonce))


# -- the exchange on a blocking socket (the mesh) ------------------------------------------------


def _recv_exact(sock: socket.socket, n: int, deadline: Deadline, what: str, peer: str) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        remaining = deadline.remaining()
        if remaining <= 0:
            raise AuthError(f"{peer} sent no {what} within {format_duration(deadline.seconds)} "
                            f"({len(buf)} of {n} bytes arrived)")
        sock.settimeout(remaining)
        try:
            chunk = sock.recv(n - len(buf))
        except socket.timeout:
            continue
        if not chunk:
            raise AuthError(f"{peer} closed the connection before its {what} was complete "
                            f"({len(buf)} of {n} bytes arrived)")
        buf += chunk
    return bytes(buf)


def connect_blocking(sock: socket.socket, token: bytes, deadline: Deadline, peer: str) -> None:
    """Authenticate to the listener at the other end of ``sock``; AuthError if it fails."""
    message = _recv_exact(sock, CHALLENGE_BYTES, deadline, "authentication challenge", peer)
    if not message.startswith(MAGIC):
        raise AuthError(f"{peer} did not open with a distlib authentication challenge: it does not "
                        f"require DISTLIB_AUTH_TOKEN, or it is not a distlib listener")
    response, nonce, listener_nonce = respond(token, message)
    sock.sendall(response)
    first = _recv_exact(sock, 1, deadline, "authentication verdict", peer)
    if first[0] == REFUSED:
        raise AuthError(f"authentication to {peer} failed: wrong token (DISTLIB_AUTH_TOKEN differs)")
    verdict = first + _recv_exact(sock, VERDICT_BYTES - 1, deadline, "authentication verdict", peer)
    if not verify_verdict(token, nonce, listener_nonce, verdict):
        raise AuthError(f"{peer} accepted this peer but could not prove it holds DISTLIB_AUTH_TOKEN: "
                        f"it is not the listener it claims to be")
