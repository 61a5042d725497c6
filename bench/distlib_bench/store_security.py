"""``distlib bench store --sections security``: what the token and TLS cost a store client.

distlib against itself, one variant per column, each ratio against the variant without
either on the same transport:

* over TCP: no token, the token (DISTLIB_AUTH_TOKEN), TLS (DISTLIB_TLS_*), both;
* over the same-host UNIX socket (what a client on the master's host uses): no token, the
  token (TLS never runs there).

Loads, for every variant in every round (variants interleaved round by round, a fresh server
process and a fresh client process each time):

* **connect**: ``CONNECTS`` clients constructed one after the other, each closed before the
  next; median and p90 of the constructor's time (connection, TLS, the token's exchange, the
  TCPStore handshake);
* **latency**: ``get`` and ``add`` of a small key for ``--seconds`` each; median and p90 per
  call;
* **throughput**: ``set`` then ``get`` of a ``BIG_BYTES`` value, ``BIG_REPEATS`` times each;
  MB/s of the median transfer (``set`` is timed until a ``check`` behind it returns, so the
  server has taken every byte).

TLS needs a certificate for 127.0.0.1: ``--tls-cert/--tls-key/--tls-ca``, or one made for the
run with the ``openssl`` command (self-signed, it is its own CA); without either, the TLS
variants are left out and the output says so.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import threading
import time
from datetime import timedelta
from typing import Any, Dict, List, Optional, Tuple

from distlib.net import raise_fd_limit
from .children import Child, run_child
from .results import Row
from .tables import Printer, Table, fmt_num
from .timing import median, quantile, timed_loop

TOKEN = b"distlib-bench-token-" + b"x" * 24
CONNECTS = 200
BIG_BYTES = 4 * 1024 * 1024
BIG_REPEATS = 16

# (name, transport, token, tls)
VARIANTS: Tuple[Tuple[str, str, bool, bool], ...] = (
    ("tcp", "tcp", False, False),
    ("tcp+token", "tcp", True, False),
    ("tcp+tls", "tcp", False, True),
    ("tcp+token+tls", "tcp", True, True),
    ("unix", "unix", False, False),
    ("unix+token", "unix", True, False),
)


def _security(token: bool, tls: bool, files: Dict[str, str], server: bool):
    from distlib.store.tcp.security import StoreSecurity

    if server:
        return StoreSecurity(TOKEN if token else None, files["cert"] if tls else "", files["key"] if tls else "")
    return StoreSecurity(TOKEN if token else None, ca=files["ca"] if tls else "")


def _server_child(conn, transport: str, token: bool, tls: bool, files: Dict[str, str]) -> None:
    """A store server alone in this process; sends ("port", p), serves until "stop"."""
    from distlib.store.tcp.server import StoreServer

    raise_fd_limit()
    os.environ["DISTLIB_STORE_UNIX"] = "1" if transport == "unix" else "0"
    server = StoreServer("127.0.0.1", 0, security=_security(token, tls, files, server=True))
    conn.send(("port", server.port))

    def stop_when_told():
        try:
            while conn.recv()[0] != "stop":
                pass
        except (EOFError, OSError):
            pass
        server.stop()

    threading.Thread(target=stop_when_told, daemon=True).start()
    server.serve_forever()


def _client_child(conn, transport: str, token: bool, tls: bool, files: Dict[str, str], port: int,
                  seconds: float, connects: int, big: int) -> Dict[str, Any]:
    from distlib.store.tcp import TCPStore

    os.environ["DISTLIB_STORE_UNIX"] = "1" if transport == "unix" else "0"
    security = _security(token, tls, files, server=False)
    timeout = timedelta(seconds=60)

    def connect():
        return TCPStore("127.0.0.1", port, timeout=timeout, security=security)

    for _ in range(5):  # warm up: imports, the TLS context, the server's first accept
        connect().close()
    durations = []
    for _ in range(connects):
        t0 = time.perf_counter()
        store = connect()
        durations.append(time.perf_counter() - t0)
        store.close()
    store = connect()
    out: Dict[str, Any] = {"transport": store.transport,
                           "connect": {"p50_us": median(durations) * 1e6, "p90_us": quantile(durations, 0.9) * 1e6}}
    store.set("key", b"v" * 32)
    for name, fn in (("get", lambda i: store.get("key")), ("add", lambda i: store.add("n", 1))):
        timed_loop(fn, min(0.05, seconds / 4), record=False)
        result = timed_loop(fn, seconds)
        out[name] = {"ops_s": result.rate, "p50_us": result.latency_quantile(0.5) * 1e6,
                     "p90_us": result.latency_quantile(0.9) * 1e6}
    if big:
        value = os.urandom(big)
        sets, gets = [], []
        for _ in range(BIG_REPEATS):
            t0 = time.perf_counter()
            store.set("big", value)
            store.check(["big"])  # the reply comes after the server has read the whole SET
            sets.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            assert len(store.get("big")) == big
            gets.append(time.perf_counter() - t0)
        out["set_mb_s"] = big / median(sets) / 1e6
        out["get_mb_s"] = big / median(gets) / 1e6
    store.close()
    return out


def make_certificate(directory: str) -> Optional[Dict[str, str]]:
    """A self-signed certificate for 127.0.0.1 made with ``openssl``, or None without it."""
    openssl = shutil.which("openssl")
    if openssl is None:
        return None
    cert, key = os.path.join(directory, "cert.pem"), os.path.join(directory, "key.pem")
    result = subprocess.run(
        [openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-keyout", key,
         "-out", cert, "-days", "1", "-subj", "/CN=distlib-bench",
         "-addext", "subjectAltName=IP:127.0.0.1,IP:::1,DNS:localhost"],
        capture_output=True, text=True, timeout=60)
    if result.returncode != 0:
        return None
    return {"cert": cert, "key": key, "ca": cert}


class SecurityBench:
    """Runs the variants and keeps one Row per figure (the variants in place of implementations)."""

    def __init__(self, rounds: int, seconds: float, say: Printer, files: Optional[Dict[str, str]] = None,
                 connects: int = CONNECTS, big: int = BIG_BYTES):
        self.rounds, self.seconds, self.say = rounds, seconds, say
        self.connects, self.big = connects, big
        self._tmp: Optional[str] = None
        if files is None:
            self._tmp = tempfile.mkdtemp(prefix="distlib-bench-tls-")
            files = make_certificate(self._tmp)
        self.files = files or {}
        self.variants = [v for v in VARIANTS if not v[3] or self.files]
        self.note = "" if self.files else ("TLS variants left out: no openssl command to make a certificate "
                                           "(give --tls-cert/--tls-key/--tls-ca)")
        names = [v[0] for v in self.variants]
        self.names = names
        self.rows: Dict[str, Row] = {}
        for key, label, unit, higher in (
            ("connect", "connect: new client, handshake done (median)", "us", False),
            ("connect_p90", "connect: p90", "us", False),
            ("get", "get, median per call", "us", False),
            ("get_p90", "get, p90", "us", False),
            ("add", "add, median per call", "us", False),
            ("set_mb_s", f"set of {self.big >> 20} MiB", "MB/s", True),
            ("get_mb_s", f"get of {self.big >> 20} MiB", "MB/s", True),
        ):
            self.rows[key] = Row("security", label, unit, higher)

    def run(self) -> None:
        try:
            for rnd in range(self.rounds):
                for name, transport, token, tls in self.variants:
                    self.say(f"  security cost, round {rnd + 1}, {name} ...")
                    server = Child(_server_child, transport, token, tls, self.files, name=f"{name}-store-server")
                    try:
                        port = server.recv(120)
                        r = run_child(_client_child, transport, token, tls, self.files, port, self.seconds,
                                      self.connects, self.big, timeout=300 + 20 * self.seconds,
                                      name=f"{name}-client")
                    finally:
                        server.stop()
                    if r["transport"] != transport:
                        raise RuntimeError(f"{name}: the client used {r['transport']}, not {transport}")
                    self.rows["connect"].add(name, r["connect"]["p50_us"])
                    self.rows["connect_p90"].add(name, r["connect"]["p90_us"])
                    self.rows["get"].add(name, r["get"]["p50_us"], ops_s=r["get"]["ops_s"])
                    self.rows["get_p90"].add(name, r["get"]["p90_us"])
                    self.rows["add"].add(name, r["add"]["p50_us"], ops_s=r["add"]["ops_s"])
                    if "set_mb_s" in r:
                        self.rows["set_mb_s"].add(name, r["set_mb_s"])
                        self.rows["get_mb_s"].add(name, r["get_mb_s"])
        finally:
            if self._tmp is not None:
                shutil.rmtree(self._tmp, ignore_errors=True)

    def table(self) -> str:
        """Each figure, per variant, with its ratio to the same transport without token or TLS."""
        table = Table(["security cost (distlib vs distlib)", "unit"] + self.names, "ll" + "r" * len(self.names))
        for row in self.rows.values():
            cells = []
            for name in self.names:
                base = "unix" if name.startswith("unix") else "tcp"
                value, ref = row.median(name), row.median(base)
                if value != value:  # NaN: not measured
                    cells.append("-")
                    continue
                ratio = value / ref if ref == ref and ref > 0 else float("nan")
                cells.append(fmt_num(value) + ("" if name == base or ratio != ratio else f" ({ratio:.2f}x)"))
            table.add("  " + row.name, row.unit, *cells)
        return table.render()

    def lines(self) -> List[str]:
        out = [f"  each figure: median of {self.rounds} round(s), variants interleaved round by round; (N.NNx): "
               f"the figure over the same transport's without token or TLS (for times, above 1 is slower; "
               f"for MB/s, below 1 is slower)"]
        if self.note:
            out.append("  " + self.note)
        return out

    def json_rows(self) -> List[Dict[str, Any]]:
        return [row.to_json(self.names, reference="-") for row in self.rows.values()]


def files_from_args(cert: Optional[str], key: Optional[str], ca: Optional[str]) -> Optional[Dict[str, str]]:
    """The TLS files given on the command line (all three, or none)."""
    if not (cert or key or ca):
        return None
    if not (cert and key and ca):
        raise ValueError("--tls-cert, --tls-key and --tls-ca go together")
    return {"cert": cert, "key": key, "ca": ca}
