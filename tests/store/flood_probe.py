"""Issue 28's probe, reproducible: three floods against a real `distlib store-server` process,
each measured as an operator would see it (the server's memory, its log, a good client's
latency). The tests (test_store_floods.py) run small versions with bounds; run the full probe
with ``python -m tests.store.flood_probe [wait|refusals|tls|all]`` for docs/security.md.

* ``wait``: connections each send one WAIT on many missing keys (100,000 keys of 200 bytes:
  about 20 MiB a request) to a server with ``--memory-budget-mb 128``: the server's RSS and
  peak before and after, how many attack connections it kept, and a good client's connect and
  get while such requests arrive.
* ``refusals``: connections that answer the token's challenge with a wrong response, as fast
  as two threads can: the server's log lines, bytes and WARNING lines.
* ``tls``: two threads doing TLS handshakes without the token as fast as they can, against a
  server with TLS and the token: their rate, and a good client's get p50/p99 and connect,
  idle and during the flood.

``--pin`` puts the attackers on the second CPU and the server and the good client on the first
(as if the attackers ran on other hosts): on a small machine, attackers on the server's CPUs
measure the CPUs' contention more than the server.

Only loopback traffic; every server and socket is closed at the end.
"""

from __future__ import annotations

import json
import os
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Dict, List, Optional

from distlib.store.tcp import TCPStore
from distlib.store.tcp import codec as proto
from distlib.store.tcp.security import StoreSecurity
from tests.fixtures.ports import free_port
from tests.fixtures.procfs import memory_bytes
from distlib.subprocesses import stop

MiB = 1024 * 1024
#: CPUs of (the server and the good client, the attackers) with ``--pin``; None: no pinning.
PIN: Optional[tuple] = None


def _pin(which: int) -> None:
    if PIN is not None:
        os.sched_setaffinity(0, PIN[which])
TOKEN = "flood-probe-token-0123456789abcdef"
HELLO = proto.validate() + proto.ping(1234)


class Server:
    """`distlib store-server` in a process on 127.0.0.1, its log in a file, TCP for clients."""

    def __init__(self, workdir: Path, *args: str, token: bool = False, tls: Optional[Dict[str, str]] = None,
                 level: str = "INFO"):
        self.port = free_port()
        self.log_path = workdir / f"store-server-{self.port}.log"
        self.log_file = open(self.log_path, "w+")
        cmd = [sys.executable, "-m", "distlib.cli", "--log-level", level, "store-server", "--port", str(self.port),
               *args]
        self.token: Optional[bytes] = None
        self.ca = ""
        if token:
            token_file = workdir / "token"
            token_file.write_text(TOKEN)
            token_file.chmod(0o600)
            cmd += ["--auth-token-file", str(token_file)]
            self.token = TOKEN.encode()
        if tls:
            cmd += ["--tls-cert", tls["good_cert"], "--tls-key", tls["good_key"]]
            self.ca = tls["ca"]
        env = dict(os.environ, DISTLIB_STORE_UNIX="0")
        env.pop("DISTLIB_AUTH_TOKEN", None)
        env.pop("DISTLIB_AUTH_TOKEN_FILE", None)
        self.proc = subprocess.Popen(cmd, stderr=self.log_file, env=env, preexec_fn=lambda: _pin(0))
        deadline = time.monotonic() + 30
        while True:
            try:
                self.client().close()
                break
            except Exception:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.close()
                    raise
                time.sleep(0.1)

    def client(self, seconds: float = 30.0) -> TCPStore:
        return TCPStore("127.0.0.1", self.port, timeout=timedelta(seconds=seconds),
                        security=StoreSecurity(self.token, ca=self.ca))

    def memory(self, field: str = "VmRSS") -> int:
        return memory_bytes(self.proc.pid, field)

    def log(self) -> str:
        return self.log_path.read_text()

    def close(self) -> None:
        stop(self.proc)
        self.log_file.close()


def _unsent(sock: socket.socket) -> int:
    """Bytes ``sock`` has sent that the peer's kernel has not acknowledged (SIOCOUTQ)."""
    import fcntl
    import termios

    buf = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0")
    return int.from_bytes(buf, sys.byteorder)


def wait_request(keys: int, key_bytes: int, tag: int) -> bytes:
    """One WAIT on ``keys`` distinct keys that nobody sets."""
    pad = b"k" * max(0, key_bytes - 24)
    return proto.keys_request(proto.Op.WAIT, [b"%s/flood/%d/%08d" % (pad, tag, i) for i in range(keys)])


def _is_closed(sock: socket.socket) -> bool:
    sock.setblocking(False)
    try:
        return sock.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True
    finally:
        sock.setblocking(True)


class GoodClient(threading.Thread):
    """A client doing gets on one connection (and, with ``connects``, a fresh connection now and
    then) until stopped: every get's and connect's time."""

    def __init__(self, server: Server, connects: bool = False, pause: float = 0.0):
        super().__init__(daemon=True)
        self.server = server
        self.connects = connects
        self.pause = pause
        self.gets: List[float] = []
        self.connect_times: List[float] = []
        self.errors: List[BaseException] = []
        self.halt = threading.Event()
        self.store = server.client()
        self.store.set("good", b"x" * 16)

    def run(self) -> None:
        clock = time.perf_counter
        try:
            n = 0
            while not self.halt.is_set():
                start = clock()
                self.store.get("good")
                self.gets.append(clock() - start)
                n += 1
                if self.connects and n % 50 == 0:
                    start = clock()
                    store = self.server.client()
                    self.connect_times.append(clock() - start)
                    store.close()
                if self.pause:
                    time.sleep(self.pause)
        except BaseException as exc:  # noqa: BLE001 - reported by stop()
            self.errors.append(exc)

    def stop(self) -> Dict[str, float]:
        self.halt.set()
        self.join(60)
        self.store.close()
        if self.errors:
            raise self.errors[0]
        return summary(self.gets, self.connect_times)


def summary(gets: List[float], connects: List[float]) -> Dict[str, float]:
    out = {"gets": len(gets)}
    if gets:
        ordered = sorted(gets)
        out.update(get_p50_ms=1e3 * ordered[len(ordered) // 2], get_p99_ms=1e3 * ordered[int(len(ordered) * 0.99)],
                   get_max_ms=1e3 * ordered[-1])
    if connects:
        out.update(connects=len(connects), connect_p50_ms=1e3 * statistics.median(connects),
                   connect_max_ms=1e3 * max(connects))
    return out


# -- the floods -------------------------------------------------------------------------------------


def _wait_attacker(port: int, keys: int, key_bytes: int, at_once: int, seconds: float, sent, ready) -> None:
    """For ``seconds``: ``at_once`` connections each send one WAIT on ``keys`` missing keys, then
    are closed, and again (its own process: building requests holds a process's GIL)."""
    _pin(1)
    requests = [wait_request(keys, key_bytes, 1000 + i) for i in range(at_once)]
    ready.set()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        socks = []
        for request in requests:
            try:
                sock = socket.create_connection(("127.0.0.1", port), timeout=30)
                socks.append(sock)
                sock.sendall(HELLO)
                sock.recv(4)
                sent.value += 1
                sock.sendall(request)
            except OSError:
                pass  # closed by the server part-way
        for sock in socks:
            sock.close()


def wait_flood(workdir: Path, conns: int = 8, keys: int = 100_000, key_bytes: int = 200, budget_mb: int = 128,
               latency_requests: int = 10, seconds: float = 3.0, extra_args=()) -> Dict[str, object]:
    """``conns`` connections each WAIT on ``keys`` missing keys: the server's memory, and the
    connections it kept; then, for ``seconds``, ``latency_requests`` such requests at a time,
    again and again, while a good client connects and gets."""
    server = Server(workdir, "--memory-budget-mb", str(budget_mb), *extra_args)
    result: Dict[str, object] = {"conns": conns, "keys": keys, "key_bytes": key_bytes, "budget_mb": budget_mb}
    socks: List[socket.socket] = []
    try:
        result["rss_before_mib"] = server.memory() / MiB
        request = wait_request(keys, key_bytes, 0)
        result["request_mib"] = len(request) / MiB
        for i in range(conns):
            sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
            sock.sendall(HELLO)
            sock.recv(4)
            socks.append(sock)
            try:
                sock.sendall(wait_request(keys, key_bytes, i))
            except OSError:
                pass  # closed by the server part-way: counted below
        _settle(server, socks)
        result["rss_after_mib"] = server.memory() / MiB
        result["rss_peak_mib"] = server.memory("VmHWM") / MiB
        result["kept"] = sum(not _is_closed(s) for s in socks)
        for s in socks:
            s.close()
        socks.clear()
        result["idle"] = _run_for(GoodClient(server, connects=True, pause=0.002), 1.0)
        import multiprocessing

        ctx = multiprocessing.get_context("fork")  # no other thread runs now
        sent = ctx.Value("i", 0)
        ready = ctx.Event()
        attacker = ctx.Process(target=_wait_attacker, args=(server.port, keys, key_bytes, latency_requests,
                                                            seconds, sent, ready), daemon=True)
        attacker.start()
        ready.wait(120)
        good = GoodClient(server, connects=True, pause=0.002)
        good.start()
        attacker.join(seconds + 120)
        _settle(server, [])
        result["during"] = good.stop()
        result["requests_sent"] = sent.value
        result["rss_peak_end_mib"] = server.memory("VmHWM") / MiB
        result["log_lines"] = len(server.log().splitlines())
    finally:
        for s in socks:
            s.close()
        server.close()
    return result


def _settle(server: Server, socks: List[socket.socket], timeout: float = 60.0) -> None:
    """Until the server's kernel has every byte of the attack sockets, and the server has
    answered a PING after that (so it has read them)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(_is_closed_quiet(s) or _unsent(s) == 0 for s in socks):
            break
        time.sleep(0.01)
    for _ in range(2):
        store = server.client()
        store.set("settled", b"1")
        store.close()


def _is_closed_quiet(sock: socket.socket) -> bool:
    try:
        return _is_closed(sock)
    except OSError:
        return True


def _run_for(client: GoodClient, seconds: float) -> Dict[str, float]:
    client.start()
    time.sleep(seconds)
    return client.stop()


def refusal_flood(workdir: Path, conns: int = 20_000, threads: int = 2) -> Dict[str, object]:
    """``conns`` connections that answer the challenge with a wrong response."""
    server = Server(workdir, token=True)
    before = len(server.log().splitlines())
    counter = iter(range(conns))
    lock = threading.Lock()

    def attack():
        while True:
            with lock:
                if next(counter, None) is None:
                    return
            try:
                with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
                    got = b""
                    while len(got) < 47:
                        chunk = sock.recv(47 - len(got))
                        if not chunk:
                            break
                        got += chunk
                    sock.sendall(b"\0" * 64)
                    sock.recv(1)
            except OSError:
                pass

    try:
        start = time.monotonic()
        workers = [threading.Thread(target=attack) for _ in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        seconds = time.monotonic() - start
        server.client().close()  # the server has handled every one of them
    finally:
        server.close()  # (at exit it logs the refusals it counted and has not logged yet)
    lines = server.log_path.read_text().splitlines()[before:]
    return {"conns": conns, "seconds": seconds, "log_lines": len(lines), "log_bytes": len("\n".join(lines)),
            "warning_lines": sum(" WARNING " in line for line in lines), "lines": lines}


def _tls_attacker(port: int, ca: str, halt, done) -> None:
    """TLS handshakes to the store at ``port`` until ``halt``, each left at the token's challenge."""
    _pin(1)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.load_verify_locations(ca)
    while not halt.is_set():
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
                with context.wrap_socket(raw, server_hostname="127.0.0.1") as tls_sock:
                    tls_sock.recv(47)  # the challenge; no token: leave
            with done.get_lock():
                done.value += 1
        except (OSError, ssl.SSLError):
            pass


def tls_flood(workdir: Path, pki: Dict[str, str], seconds: float = 5.0, processes: int = 2,
              gets_idle_s: float = 3.0) -> Dict[str, object]:
    """``processes`` processes doing TLS handshakes without the token against a TLS + token
    server (processes, so that the good client's latency is not its own process's GIL)."""
    server = Server(workdir, token=True, tls=pki)
    result: Dict[str, object] = {}
    try:
        result["idle"] = _run_for(GoodClient(server, connects=True, pause=0.0005), gets_idle_s)
        import multiprocessing

        ctx = multiprocessing.get_context("fork")  # no other thread runs now
        halt = ctx.Event()
        done = ctx.Value("i", 0)
        workers = [ctx.Process(target=_tls_attacker, args=(server.port, pki["ca"], halt, done), daemon=True)
                   for _ in range(processes)]
        start = time.monotonic()
        for w in workers:
            w.start()
        time.sleep(0.5)
        good = GoodClient(server, connects=True, pause=0.0005)
        good.start()
        time.sleep(seconds)
        result["during"] = good.stop()
        halt.set()
        for w in workers:
            w.join(30)
        result["handshakes_per_s"] = done.value / (time.monotonic() - start)
        result["log_lines"] = len(server.log().splitlines())
    finally:
        server.close()
    return result


def main(argv: List[str]) -> int:
    global PIN
    if "--pin" in argv:
        argv = [a for a in argv if a != "--pin"]
        PIN = ({0}, {1})
        _pin(0)
    which = argv[0] if argv else "all"
    out: Dict[str, object] = {}
    with tempfile.TemporaryDirectory(prefix="distlib-flood-") as tmp:
        work = Path(tmp)
        if which in ("wait", "all"):
            out["wait"] = wait_flood(work)
        if which in ("refusals", "all"):
            result = refusal_flood(work)
            lines = result.pop("lines")
            result["first_lines"], result["last_lines"] = lines[:3], lines[-3:]
            out["refusals"] = result
        if which in ("tls", "all"):
            from tests.fixtures import certs

            out["tls"] = tls_flood(work, certs.make(work / "pki"))
    print(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
