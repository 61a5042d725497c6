"""``distlib store-server`` in a subprocess: started on a free port, answering, stopped.

The demo, the store benchmark and the tests need a master service exactly as a deployment runs
it (the command, in its own process), up before anyone connects and gone afterwards, whatever
happened. One helper does it, so that a port taken between choosing and binding, a server that
dies at start and a server that never answers are handled once.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from typing import IO, Dict, List, Optional, Sequence

from distlib.errors import DistError
from distlib.subprocesses import stop

#: Fresh ports tried before giving up, when another process takes the chosen one first.
START_ATTEMPTS = 3


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on at ``host`` right now (the kernel's pick; another process
    could take it before the caller binds it: callers that bind it later retry)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class StoreServerProcess:
    """``distlib store-server --host LISTEN --port PORT`` as a child process.

    ``port=0`` picks a free port (and another one if that was taken before the server bound
    it); ``listen_host`` defaults to ``host``, the address the readiness check and the users
    connect to (pass ``"0.0.0.0"`` to serve every interface). The server's log goes to
    ``log_path`` when given, else to this process's stderr. Use as a context manager, or
    ``start()`` / ``stop()``.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, listen_host: Optional[str] = None,
                 log_level: str = "WARNING", log_path: Optional[str] = None,
                 env: Optional[Dict[str, str]] = None, args: Sequence[str] = ()):
        self.host = host
        self.port = port
        self.listen_host = listen_host or host
        self.log_level = log_level
        self.log_path = log_path
        self.env = env
        self.args = list(args)  # more of the command's options (--state-dir DIR, --sync none)
        self.proc: Optional[subprocess.Popen] = None
        self._log: Optional[IO[str]] = None

    @property
    def endpoint(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def command(self, port: int) -> List[str]:
        return [sys.executable, "-m", "distlib.cli", "store-server", "--host", self.listen_host,
                "--port", str(port), "--log-level", self.log_level] + self.args

    def start(self, timeout: float = 15.0) -> "StoreServerProcess":
        """Start the server and return once it answers a PING; RuntimeError (naming the
        endpoint, the time and the last thing that went wrong) when it does not."""
        deadline = time.monotonic() + timeout
        fixed = self.port != 0
        last: Optional[str] = "it was never started"
        for _attempt in range(1 if fixed else START_ATTEMPTS):
            port = self.port if fixed else free_port(self.host)
            self._spawn(port)
            last = self._wait_answering(port, deadline)
            if last is None:
                self.port = port
                return self
            exited = self._started().poll() is not None
            self.stop()
            if not exited or time.monotonic() >= deadline:
                break  # alive but silent, or out of time: another port would not help
        where = f"{self.host}:{self.port or port}"
        raise RuntimeError(f"distlib store-server on {where} did not answer within {timeout:.0f} s: {last}")

    def _spawn(self, port: int) -> None:
        if self.log_path and self._log is None:
            self._log = open(self.log_path, "a+")
        self.proc = subprocess.Popen(self.command(port), env=self.env, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=self._log)

    def _started(self) -> subprocess.Popen:
        if self.proc is None:
            raise RuntimeError("the store server process was not started (StoreServerProcess.start)")
        return self.proc

    def _wait_answering(self, port: int, deadline: float) -> Optional[str]:
        """None once the server answers a PING; else why it did not before ``deadline``. The
        port is probed with plain connects until something listens (so that the store
        client's retry log stays quiet while the server starts), then with short PINGs, so
        that a server that died (its port taken by another process) is noticed in a second."""
        from distlib.launcher.master import check_answers

        last, listening = "no answer", False
        while time.monotonic() < deadline:
            if self._started().poll() is not None:
                return f"it exited with status {self._started().returncode}"
            if not listening:
                try:
                    socket.create_connection((self.host, port), timeout=0.2).close()
                    listening = True
                except OSError as exc:  # not listening yet; the deadline bounds the loop
                    last = f"connect: {exc}"
                    time.sleep(0.02)
                continue
            try:
                check_answers(self.host, port, min(1.0, max(0.05, deadline - time.monotonic())))
                return None
            except (DistError, OSError) as exc:
                last = str(exc)
        return last

    def stop(self, timeout: float = 10.0) -> Optional[int]:
        """SIGTERM (the server exits cleanly on it), then SIGKILL after ``timeout``; the exit
        status, or None if it was not running."""
        status = None if self.proc is None else stop(self.proc, timeout)
        if self._log is not None:
            self._log.close()
            self._log = None
        return status

    def kill(self) -> None:
        """SIGKILL, as a crash or the OOM killer ends it (nothing flushed, no lock released but by
        the kernel); ``start()`` again brings it back on the same port."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def log_text(self) -> str:
        """What the server logged so far (with ``log_path``; "" without)."""
        if not self.log_path:
            return ""
        with open(self.log_path) as fh:
            return fh.read()

    def __enter__(self) -> "StoreServerProcess":
        return self.start() if self.proc is None or self.proc.poll() is not None else self

    def __exit__(self, *exc_info) -> None:
        self.stop()
