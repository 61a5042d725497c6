"""Who gets in: what a new connection to the store server must do before its first request runs.

In order, each step only when it applies:

1. **Same-host socket: the same user.** A client on the abstract UNIX socket must run as the
   server's user (the kernel's peer credentials, SO_PEERCRED); anyone else is refused at
   accept (``net.same_user``).
2. **TLS** (TCP connections, when the server has a certificate): the first byte must start a
   TLS handshake; plaintext (a TCPStore handshake, a torch client) gets a TLS alert and is
   closed; then the handshake, on the server's handshake thread (``advance_tls``,
   tls_handshakes.py), so that handshakes never hold up the event loop's clients.
3. **The token** (when the server has one): the server sends its challenge at once
   (distlib/auth.py); the client's 64-byte response must prove the token, or the client gets
   REFUSED and is closed. Exactly the response's bytes are read before the verdict.
4. **VALIDATE**: the TCPStore handshake's first message, with torch's magic.

All of it within ``TIMEOUT_S`` of the accept, or the connection is closed: a peer that
connects and says nothing (or trickles bytes) holds a descriptor, never the server. Until a
peer has proven anything (the token's response; VALIDATE on a store without a token) it is a
**stranger** (``is_stranger``): it must prove itself within ``ANSWER_TIMEOUT_S`` of the accept,
and strangers have a budget of their own (intake.py: at its cap the oldest makes room for the
newest), so that half-open connections cannot hold the slots a client with the token needs.
Every refusal names the peer's address and what it did in the server's log; a peer that
closes having sent nothing (a TCP health probe) is logged at INFO only.

This module drives one connection through the steps (``Admission.advance``); the server
keeps such connections apart from admitted ones until ``advance`` says ADMITTED, so none of
this touches the per-request path. Connections are duck-typed (``sock``, ``peer``, ``out``,
``gate``, ``tls``): this module does not import the server.
"""

from __future__ import annotations

import socket
import ssl
from typing import Optional

from ... import auth, tls
from .codec import MAGIC, U32, Op

#: Everything before the first request (TLS, the token, VALIDATE) must be done this long after
#: the accept. A real client needs a round trip or two; 10 s covers a loaded machine.
TIMEOUT_S = 10.0
#: ... and a stranger must prove itself (answer the token's challenge; send VALIDATE to a store
#: without a token) this long after the accept: a real client answers in a round trip (its
#: TLS handshake included), and one cut short by a loaded machine connects again (handshake.py).
ANSWER_TIMEOUT_S = 3.0

#: Bytes a VALIDATE step reads at most (what follows goes to the request path).
_VALIDATE_READ = 64
_VALIDATE_BYTES = bytes([Op.VALIDATE]) + U32.pack(MAGIC)

# Steps of a connection on its way in.
PEEK_TLS, TLS, AUTH, VALIDATE = range(4)
_STEP_NAMES = {PEEK_TLS: "the TLS handshake", TLS: "the TLS handshake", AUTH: "authentication",
               VALIDATE: "the TCPStore handshake (VALIDATE)"}

# What ``advance`` (and ``advance_tls``) returns.
WAITING, WANT_WRITE, ADMITTED, TLS_DONE = range(4)


class Refused(Exception):
    """Close this connection: ``reason`` for the log (a warning, INFO when ``quiet``), and
    ``reply`` sent first (best effort) so that the peer learns why."""

    def __init__(self, reason: str, quiet: bool = False, reply: bytes = b""):
        super().__init__(reason)
        self.quiet = quiet
        self.reply = reply


class Gate:
    """One connection's progress through the steps, and the bytes read and not yet used."""

    __slots__ = ("step", "got", "nonce", "deadline", "answer_by")

    def __init__(self, step: int, deadline: float, answer_by: float):
        self.step = step
        self.got = bytearray()
        self.nonce: Optional[bytes] = None
        self.deadline = deadline  # everything done by then
        self.answer_by = answer_by  # a stranger proven by then


class Admission:
    """The steps for one server's connections: its token and TLS context (either may be None)."""

    def __init__(self, token: Optional[bytes], tls_context: Optional[ssl.SSLContext]):
        self.token = token
        self.tls_context = tls_context

    def open(self, conn, local: bool, accepted: float) -> None:
        """A connection was accepted at ``accepted`` (time.monotonic()): its first step (the
        challenge goes out now, if any), its deadlines."""
        deadline, answer_by = accepted + TIMEOUT_S, accepted + ANSWER_TIMEOUT_S
        if self.tls_context is not None and not local:
            conn.gate = Gate(PEEK_TLS, deadline, answer_by)
        else:
            conn.gate = Gate(AUTH if self.token else VALIDATE, deadline, answer_by)
            if self.token:
                self._challenge(conn)

    def _challenge(self, conn) -> None:
        message, conn.gate.nonce = auth.challenge()
        conn.out.append(message)

    @staticmethod
    def step_name(conn) -> str:
        return _STEP_NAMES[conn.gate.step]

    def is_stranger(self, conn) -> bool:
        """Whether ``conn``, on its way in, has proven nothing yet: not the token (its TLS
        handshake or its challenge still to come), or, on a store without a token, not
        VALIDATE."""
        step = conn.gate.step
        return step != VALIDATE or not self.token

    def unproven(self, conn) -> str:
        """What the stranger ``conn`` has not sent yet, for the log."""
        step = conn.gate.step
        if step == AUTH:
            return "its answer to the authentication challenge"
        if step == VALIDATE:
            return "its TCPStore handshake (VALIDATE)"
        return "its TLS handshake"

    @staticmethod
    def needs_tls(conn) -> bool:
        """Whether ``conn``'s next step is TLS (its handshake thread's part: tls_handshakes.py)."""
        return conn.gate.step in (PEEK_TLS, TLS)

    def advance_tls(self, conn) -> int:
        """The TLS steps alone, as far as the bytes allow: WAITING, WANT_WRITE, or TLS_DONE once
        the handshake is done (the next step is set, and the token's challenge, if any, waits
        in ``conn.out``). Raises Refused. The handshake thread runs this, never the loop."""
        if conn.gate.step == PEEK_TLS and not self._peek_tls(conn):
            return WAITING
        outcome = self._handshake(conn)
        return TLS_DONE if outcome is None else outcome

    def advance(self, conn) -> int:
        """Go as far as the bytes that arrived allow: WAITING (for bytes), WANT_WRITE (the TLS
        handshake waits for the socket to take bytes), or ADMITTED (``conn.gate.got`` then
        holds bytes that already belong to requests). Raises Refused."""
        gate = conn.gate
        while True:
            step = gate.step
            if step == PEEK_TLS:
                if not self._peek_tls(conn):
                    return WAITING
            elif step == TLS:
                outcome = self._handshake(conn)
                if outcome is not None:
                    return outcome
            elif step == AUTH:
                if not self._read(conn, auth.RESPONSE_BYTES - len(gate.got)):
                    return WAITING
                if len(gate.got) < auth.RESPONSE_BYTES:
                    continue
                self._verify(conn)
            else:
                self._check_validate(gate.got)
                if len(gate.got) >= len(_VALIDATE_BYTES):
                    del gate.got[: len(_VALIDATE_BYTES)]
                    return ADMITTED
                if not self._read(conn, _VALIDATE_READ):
                    return WAITING

    # -- the steps -------------------------------------------------------------------------------

    def _read(self, conn, n: int) -> bool:
        """Read up to ``n`` bytes into ``gate.got``; False when nothing came. Refused at EOF."""
        try:
            data = conn.sock.recv(n)
        except (BlockingIOError, InterruptedError):
            return False
        except ConnectionResetError:
            if conn.gate.step == AUTH:  # a client that met the challenge unprepared and left
                raise Refused("refused: it reset the connection during authentication (a client without "
                              "DISTLIB_AUTH_TOKEN, or a torch client, gives up at the challenge)") from None
            raise Refused(f"disconnected (reset) during {self.step_name(conn)}") from None
        except OSError as exc:
            raise Refused(f"receive failed during {self.step_name(conn)} ({exc.strerror or exc})") from None
        if not data:
            raise self._closed_early(conn)
        conn.gate.got += data
        return True

    def _closed_early(self, conn) -> Refused:
        gate = conn.gate
        got = bytes(gate.got)
        if not got:
            return Refused(f"disconnected before {self.step_name(conn)}", quiet=True)
        if gate.step == AUTH:
            if got.startswith(_VALIDATE_BYTES[: len(got)]):
                return Refused(_NO_TOKEN)
            return Refused(f"refused: it closed the connection after {len(got)} of {auth.RESPONSE_BYTES} bytes "
                           f"of its authentication response")
        return Refused(f"disconnected during {self.step_name(conn)} (first bytes: {got[:16]!r})")

    def _peek_tls(self, conn) -> bool:
        try:
            first = conn.sock.recv(1, socket.MSG_PEEK)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError as exc:
            raise Refused(f"receive failed before the TLS handshake ({exc.strerror or exc})") from None
        if not first:
            raise Refused("disconnected before the TLS handshake", quiet=True)
        if first[0] != tls.HANDSHAKE_RECORD:
            what = "a TCPStore handshake" if first[0] == Op.VALIDATE else f"first byte 0x{first[0]:02x}"
            raise Refused(f"refused: it speaks plaintext ({what}) to a store that requires TLS: a distlib client "
                          f"needs DISTLIB_TLS_CA; torch clients cannot use TLS", reply=tls.PLAINTEXT_REFUSAL)
        assert self.tls_context is not None, "a TLS step only where TLS is required"
        conn.sock = self.tls_context.wrap_socket(conn.sock, server_side=True, do_handshake_on_connect=False)
        conn.gate.step = TLS
        return True

    def _handshake(self, conn) -> Optional[int]:
        try:
            conn.sock.do_handshake()
        except ssl.SSLWantReadError:
            return WAITING
        except ssl.SSLWantWriteError:
            return WANT_WRITE
        except (ssl.SSLError, OSError) as exc:
            if isinstance(exc, (ssl.SSLEOFError, ConnectionResetError, BrokenPipeError)):
                raise Refused("disconnected during the TLS handshake (the client may not trust this server's "
                              "certificate: see its error)") from None
            raise Refused(f"refused: TLS handshake failed: {tls.describe_client_failure(exc)}") from None
        conn.sock = tls.TlsSocket(conn.sock)
        conn.tls = True
        if self.token:
            conn.gate.step = AUTH
            self._challenge(conn)
        else:
            conn.gate.step = VALIDATE
        return None

    def _verify(self, conn) -> None:
        gate = conn.gate
        response = bytes(gate.got[: auth.RESPONSE_BYTES])
        assert self.token is not None, "a token step only with a token"
        verdict = auth.verify_response(self.token, gate.nonce, response)
        if verdict is None:
            if response.startswith(_VALIDATE_BYTES):
                raise Refused(_NO_TOKEN, reply=bytes([auth.REFUSED]))
            raise Refused("refused: wrong token: its authentication response does not prove DISTLIB_AUTH_TOKEN",
                          reply=bytes([auth.REFUSED]))
        conn.out.append(verdict)
        del gate.got[: auth.RESPONSE_BYTES]
        gate.nonce = None
        gate.step = VALIDATE

    @staticmethod
    def _check_validate(got: bytearray) -> None:
        if not got:
            return
        if got[0] != Op.VALIDATE:
            if got[0] == tls.HANDSHAKE_RECORD:
                raise Refused(f"first message must be VALIDATE with magic 0x{MAGIC:08x}, got a TLS handshake: the "
                              f"client uses TLS (DISTLIB_TLS_CA) and this server does not (--tls-cert/--tls-key)")
            raise Refused(
                f"first message must be VALIDATE with magic 0x{MAGIC:08x}, got opcode 0x{got[0]:02x} "
                f"(not a TCPStore client? first bytes: {bytes(got[:16])!r})")
        if len(got) >= len(_VALIDATE_BYTES) and bytes(got[: len(_VALIDATE_BYTES)]) != _VALIDATE_BYTES:
            magic = U32.unpack_from(got, 1)[0]
            raise Refused(f"first message must be VALIDATE with magic 0x{MAGIC:08x}, got magic 0x{magic:08x}")


_NO_TOKEN = ("refused: it sent a TCPStore handshake instead of authenticating: a client without "
             "DISTLIB_AUTH_TOKEN (torch clients cannot authenticate)")
