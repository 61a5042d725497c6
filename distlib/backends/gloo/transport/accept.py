"""The accepting side of a mesh's set-up: every connection that arrives goes through its
handshake (the token's challenge-response when the job has one, then the HELLO frame that
names the peer) at the same time as the others.

Why: a connection that sends nothing (a port scanner, an impostor, a stuck client) must not
hold up the real peers behind it. Taken one at a time, each such connection held the
listener for its whole reply limit, so a few of them could outlast a rank's init timeout;
here one only occupies its own slot until its limit passes. Real peers also no longer wait
for each other's round trips, which is most of what the token costs at init.

Nothing a connection sends is read beyond the handshake's bytes: frames that follow the
HELLO stay in the socket for the mesh.
"""

from __future__ import annotations

import selectors
import socket
import time
from typing import Callable, Dict, List, Optional, Set, Tuple

from .... import auth
from ....deadline import Deadline, format_duration
from ....net import format_endpoint, tune
from . import frames

HELLO_BYTES = frames.HEADER_SIZE + frames.HELLO_PAYLOAD.size

#: refuse(host, "host:port", reason): a connection failed authentication (the mesh logs it
#: and names it in its timeout error).
Refuse = Callable[[str, str, str], None]


class _Pending:
    """One accepted connection in the middle of its handshake."""

    __slots__ = ("sock", "host", "where", "stage", "buf", "nonce", "due")

    def __init__(self, sock: socket.socket, host: str, where: str, stage: str, nonce: bytes, due: float):
        self.sock = sock
        self.host = host
        self.where = where
        self.stage = stage  # "auth": waiting for the response to the challenge; "hello": for HELLO
        self.buf = bytearray()
        self.nonce = nonce
        self.due = due

    @property
    def need(self) -> int:
        return (auth.RESPONSE_BYTES if self.stage == "auth" else HELLO_BYTES) - len(self.buf)


class Handshakes:
    """Accept on ``listener`` until every expected rank has said HELLO (or the deadline).

    ``reply_s`` bounds each stage of each connection; ``refuse`` is told of every connection
    that failed authentication; ``log`` of the others dropped (not this group's, a duplicate,
    silent before its HELLO).
    """

    def __init__(self, listener: socket.socket, size: int, mesh_id: int, token: Optional[bytes],
                 reply_s: float, refuse: Refuse, log: Callable[..., None]):
        self.listener = listener
        self.size = size
        self.mesh_id = mesh_id
        self.token = token
        self.reply_s = reply_s
        self.refuse = refuse
        self.log = log

    def run(self, expected: Set[int], deadline: Deadline) -> List[Tuple[int, socket.socket]]:
        """(peer, socket) of every expected rank that completed its handshake before the
        deadline, in arrival order; the caller names the ones missing."""
        expected = set(expected)
        done: List[Tuple[int, socket.socket]] = []
        pending: Dict[int, _Pending] = {}
        with selectors.DefaultSelector() as selector:
            selector.register(self.listener, selectors.EVENT_READ)
            try:
                while expected and not deadline.expired():
                    now = time.monotonic()
                    wake = min([deadline.remaining()] + [max(0.0, p.due - now) for p in pending.values()])
                    for key, _ in selector.select(wake):
                        if key.fileobj is self.listener:
                            self._accept(selector, pending)
                            continue
                        entry = pending[key.fd]
                        peer = self._read(entry)
                        if entry.stage != "closed" and peer is None:
                            continue  # its handshake goes on
                        selector.unregister(entry.sock)
                        del pending[key.fd]
                        if peer is not None and peer in expected:
                            expected.discard(peer)
                            entry.sock.setblocking(True)
                            done.append((peer, entry.sock))
                            continue
                        if peer is not None:
                            self.log("dropped a second connection that says it is rank %d", peer)
                        entry.sock.close()
                    self._expire(selector, pending)
            finally:
                for entry in pending.values():
                    entry.sock.close()
        return done

    # -- the steps ---------------------------------------------------------------------------

    def _accept(self, selector, pending: Dict[int, _Pending]) -> None:
        try:
            sock, addr = self.listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:  # EMFILE and the like: the others go on; the deadline bounds it
            self.log("accept failed: %s", exc)
            return
        host = addr[0] if isinstance(addr, tuple) else str(addr)
        where = format_endpoint(host, addr[1]) if isinstance(addr, tuple) else host
        tune(sock)
        sock.setblocking(False)
        nonce = b""
        stage = "hello"
        if self.token is not None:
            message, nonce = auth.challenge()
            if not self._send(sock, message):
                self.refuse(host, where, "the connection closed before the authentication challenge went out")
                sock.close()
                return
            stage = "auth"
        entry = _Pending(sock, host, where, stage, nonce, time.monotonic() + self.reply_s)
        pending[sock.fileno()] = entry
        selector.register(sock, selectors.EVENT_READ)

    def _read(self, entry: _Pending) -> Optional[int]:
        """Read what the connection's stage still needs; the peer's rank once its HELLO is
        complete and valid, else None (``entry.stage`` becomes "closed" when it is dropped)."""
        error: Optional[OSError] = None
        try:
            chunk = entry.sock.recv(entry.need)
        except (BlockingIOError, InterruptedError):
            return None
        except OSError as exc:
            chunk, error = b"", exc
        if not chunk:
            self._drop(entry, f"it closed the connection ({error or 'end of stream'}) {self._progress(entry)}")
            return None
        entry.buf += chunk
        if entry.need:
            return None
        if entry.stage == "auth":
            self._verify(entry)
            return None
        return self._hello(entry)

    def _verify(self, entry: _Pending) -> None:
        assert self.token is not None, "the auth stage exists only with a token"
        verdict = auth.verify_response(self.token, entry.nonce, bytes(entry.buf))
        if verdict is None:
            self._send(entry.sock, bytes([auth.REFUSED]))
            self._drop(entry, "it failed authentication: its response does not prove DISTLIB_AUTH_TOKEN")
            return
        if not self._send(entry.sock, verdict):
            self._drop(entry, "it closed the connection before the authentication verdict went out")
            return
        entry.stage, entry.buf, entry.due = "hello", bytearray(), time.monotonic() + self.reply_s

    def _hello(self, entry: _Pending) -> Optional[int]:
        data = bytes(entry.buf)
        kind = data[0]
        peer, mesh_id = frames.HELLO_PAYLOAD.unpack_from(data, frames.HEADER_SIZE)
        if kind != frames.HELLO or mesh_id != self.mesh_id or not 0 <= peer < self.size:
            self.log("refused a connection from %s that is not from this group (kind %d, mesh %x)",
                     entry.where, kind, mesh_id)
            entry.stage = "closed"
            return None
        return peer

    def _expire(self, selector, pending: Dict[int, _Pending]) -> None:
        now = time.monotonic()
        for fd, entry in list(pending.items()):
            if entry.due <= now:
                selector.unregister(entry.sock)
                del pending[fd]
                self._drop(entry, f"it sent nothing more within {format_duration(self.reply_s)} "
                                  f"{self._progress(entry)}")
                entry.sock.close()

    def _drop(self, entry: _Pending, reason: str) -> None:
        """Report why the connection is dropped (the caller closes it)."""
        if entry.stage == "auth":
            self.refuse(entry.host, entry.where, reason)
        elif entry.stage == "hello":
            self.log("dropped the connection from %s before its HELLO: %s", entry.where, reason)
        entry.stage = "closed"  # the caller unregisters and closes it

    @staticmethod
    def _progress(entry: _Pending) -> str:
        total = auth.RESPONSE_BYTES if entry.stage == "auth" else HELLO_BYTES
        what = "authentication response" if entry.stage == "auth" else "HELLO"
        return f"({len(entry.buf)} of the {total} bytes of its {what} arrived)"

    @staticmethod
    def _send(sock: socket.socket, data: bytes) -> bool:
        """Send a few bytes on a fresh non-blocking connection (its buffer is empty, so they
        go at once); False when the connection is gone or, absurdly, full."""
        try:
            return sock.send(data) == len(data)
        except OSError:
            return False
