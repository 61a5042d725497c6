"""A scripted TCP peer: reads exact bytes from a client, answers exact bytes.

Pins what the TCPStore client puts on the wire, and lets a test play a torch server's
quirks (no ordered waits, spurious wake-ups, the cancel race) without torch.
"""

from __future__ import annotations

import socket
import threading
from typing import List, Optional, Tuple, Union

Step = Tuple[str, Union[bytes, int, float]]  # ("expect", bytes) | ("send", bytes) | ("silence", seconds)


class ScriptedServer:
    def __init__(self, script: List[Step]):
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(1)
        self.port = self.listener.getsockname()[1]
        self.script = script
        self.error: Optional[str] = None
        self.received = bytearray()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _recv_exact(self, conn: socket.socket, n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = conn.recv(n - len(data))
            if not chunk:
                raise EOFError(f"client closed after {len(data)} of {n} expected bytes")
            data += chunk
        return data

    def _run(self) -> None:
        self.listener.settimeout(10)
        try:
            conn, _ = self.listener.accept()
        except OSError as exc:
            self.error = f"no client connected: {exc}"
            self.done.set()
            return
        conn.settimeout(10)
        try:
            for kind, arg in self.script:
                if kind == "expect":
                    got = self._recv_exact(conn, len(arg))
                    self.received += got
                    if got != arg:
                        self.error = f"expected {arg.hex(' ')}, got {got.hex(' ')}"
                        return
                elif kind == "send":
                    conn.sendall(arg)
                elif kind == "silence":
                    conn.settimeout(arg)
                    try:
                        extra = conn.recv(1, socket.MSG_PEEK)
                    except socket.timeout:
                        extra = b""
                    conn.settimeout(10)
                    if extra:
                        self.error = f"client sent {extra.hex()} during a silence"
                        return
        except Exception as exc:  # noqa: BLE001 - reported to the test
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            self.done.set()
            self.conn = conn

    def finish(self) -> None:
        self.done.wait(15)
        self.listener.close()
        assert self.error is None, self.error
