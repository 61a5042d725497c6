"""The bench's control channel to ranks it did not fork: a UNIX socket in a private directory
(mode 700: only this user can connect), carrying pickled messages, each framed by its length.

Why not pipes: ranks started by mpirun are not the bench's children and inherit none of its
file descriptors. Why a socket path rather than TCP: the directory's permissions are the
authentication, and nothing listens on the network.
"""

from __future__ import annotations

import pickle
import select
import socket
import struct
import time
from typing import Any, Optional

from .children import BenchError

_HEADER = struct.Struct("!Q")


class Channel:
    """One end of a connection: ``send(obj)``, ``recv(timeout)``."""

    def __init__(self, sock: socket.socket, peer: str):
        self.sock = sock
        self.peer = peer

    def send(self, obj: Any) -> None:
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            self.sock.sendall(_HEADER.pack(len(data)) + data)
        except OSError as exc:
            raise BenchError(f"{self.peer}: the connection broke while sending ({exc})") from None

    def recv(self, timeout: Optional[float]) -> Any:
        """The next message; BenchError when none arrives within ``timeout`` seconds (None:
        no limit) or the peer closed the connection (EOFError)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        size = _HEADER.unpack(self._read(_HEADER.size, deadline, timeout))[0]
        return pickle.loads(self._read(size, deadline, timeout))

    def _read(self, n: int, deadline: Optional[float], timeout: Optional[float]) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and (left <= 0 or not select.select([self.sock], [], [], left)[0]):
                raise BenchError(f"{self.peer} sent nothing within {timeout:.0f} s")
            try:
                chunk = self.sock.recv(min(n - len(buf), 1 << 20))
            except OSError as exc:
                raise BenchError(f"{self.peer}: the connection broke ({exc})") from None
            if not chunk:
                raise EOFError(f"{self.peer} closed the connection")
            buf += chunk
        return bytes(buf)

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


def connect(path: str, name: str) -> Channel:
    """The ranks' end: connect to the bench listening at ``path``."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    return Channel(sock, name)
