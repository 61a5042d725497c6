"""The harness's end of the ranks' reports: a UNIX socket in the run directory.

Every Python process of the job (through the sitecustomize the harness puts on its path) and
the master service's observer connect here and send JSON lines. A UNIX socket reaches into
network namespaces and, through the bind-mounted run directory, into containers, without a
network path that a partition fault could cut.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
from typing import Callable, Dict, List, Optional

from .events import Event, EventLog

log = logging.getLogger("distlib.testing")

#: longest a held rank waits for the schedule to look at its event before it is let go
GATE_WAIT_S = 120.0


class Channel:
    """Accepts connections on ``path``; each line becomes an Event in ``log``.

    ``gates_for(hello)`` gives the collective numbers at which that process must wait; a held
    process is answered once the schedule has looked at its event (``EventLog.wait_seen``).
    ``adjust`` may rewrite each event first (the cluster names a store operation's host).
    """

    def __init__(self, path: str, log_: EventLog, gates_for: Callable[[Event], List[int]],
                 adjust: Optional[Callable[[Event], Event]] = None):
        self.path = path
        self.adjust = adjust
        self.log = log_
        self.gates_for = gates_for
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._server.bind(path)
        os.chmod(path, 0o777)  # a container's root or another uid may be the client
        self._server.listen(256)
        self._conns: List[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._accept, name="distlib-testing-channel", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                self._conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), name="distlib-testing-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with contextlib.suppress(OSError), conn.makefile("rb") as reader:
            for raw in reader:
                try:
                    msg: Dict = json.loads(raw)
                except ValueError:
                    continue
                event = Event(str(msg.pop("kind", "?")), str(msg.pop("node", "?")), float(msg.pop("t", 0.0)),
                              int(msg.pop("rank", -1)), int(msg.pop("pid", 0)), msg)
                if self.adjust is not None:
                    event = self.adjust(event)
                index = self.log.append(event)
                if event.kind == "hello":
                    conn.sendall(json.dumps({"gates": self.gates_for(event)}).encode() + b"\n")
                elif event.kind == "collective" and msg.get("gate"):
                    if not self.log.wait_seen(index, GATE_WAIT_S):
                        log.warning("distlib.testing: %s was held %.0f s at its cue; let go", event.describe(),
                                    GATE_WAIT_S)
                    conn.sendall(b"go\n")

    def close(self) -> None:
        self._closed = True
        # Wake the accepting thread and wait for it before closing: a thread still blocked in
        # accept() on a closed descriptor's number would accept on the next listener that gets
        # that number (another run's), and drop its connections.
        with contextlib.suppress(OSError):
            self._server.shutdown(socket.SHUT_RDWR)
        self._thread.join(10)
        with contextlib.suppress(OSError):
            self._server.close()
        with self._lock:
            for conn in self._conns:
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
                conn.close()
        with contextlib.suppress(OSError):
            os.unlink(self.path)


def unix_path_ok(path: str) -> Optional[str]:
    """None when ``path`` fits a UNIX socket address (108 bytes), else why not."""
    return None if len(path.encode()) < 104 else f"{path} is too long for a UNIX socket ({len(path)} bytes)"
