"""``python -m distlib.testing.master --port P --socket S``: the master service of a harness run.

distlib's TCP store server, as ``distlib store-server`` runs it, that also tells the harness
over its socket when it is listening (so the ranks start only then, and a restart is known to
be complete) and, through the server's observer (distlib/store/tcp/observe.py), every operation
it receives: (peer, op, keys), keys as on the wire (a TCPStore client, torch's too, puts "/" in
front). The observer turns the server's batch path off: every request is heard. With
``--state-dir`` it journals its keys and replays them when started again (a run's
``keep_master_state``), and says it is ready only once they are back.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import socket
import sys
import threading
import time
from typing import List, Optional


class Reporter:
    """JSON lines to the harness's socket; silent (once said) when the harness is gone."""

    def __init__(self, path: str, node: str):
        self.node = node
        self._lock = threading.Lock()
        self._sock: Optional[socket.socket] = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(10)
        self._sock.connect(path)

    def send(self, kind: str, **data: object) -> None:
        line = json.dumps({"kind": kind, "node": self.node, "t": time.time(), **data}).encode() + b"\n"
        with self._lock:
            if self._sock is None:
                return
            try:
                self._sock.sendall(line)
            except OSError as exc:
                self._sock = None
                print(f"distlib.testing.master: the harness's socket broke ({exc}); serving on unobserved",
                      file=sys.stderr)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m distlib.testing.master")
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--socket", required=True, help="the harness's UNIX socket")
    parser.add_argument("--node", default="master")
    parser.add_argument("--state-dir", help="journal the keys here and replay them at start, as "
                                           "`distlib store-server --state-dir` (Cluster.run(keep_master_state=True))")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)

    from distlib.store.tcp.server import StoreServer

    reporter = Reporter(args.socket, args.node)

    def observe(peer: str, op: str, keys: tuple) -> None:
        reporter.send("store", peer=peer, op=op, keys=[k.decode("utf-8", "backslashreplace") for k in keys])

    kept = {"state_dir": args.state_dir} if args.state_dir else {}
    server = StoreServer(args.host, args.port, log_connections=True, observer=observe, **kept)
    signal.signal(signal.SIGTERM, lambda *_: server.stop())
    reporter.send("ready", port=server.port)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
