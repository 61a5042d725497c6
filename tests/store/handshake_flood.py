"""Issue 37's first finding, reproducible: half-open connections that never answer the token's
challenge, from the address the token holders use, against a real `distlib store-server`.

* ``half_open_flood``: an attacker holds ``conns`` TCP connections from 127.0.0.1 that never
  answer the challenge, opening a new one for each the server closes; meanwhile token holders
  from 127.0.0.1 connect over TCP (each with its own timeout) and set and get a key. Returns
  their connect times and errors, and how many half-open connections the attacker held.
* ``job_times``: a 2-node elastic job (two `distlib-run` launchers, c10d, the token, TCP only:
  the same-host socket would go around the flood) timed from launch to both launchers' exit,
  quiet and under the flood, alternating.

The test (test_store_floods.py) runs a small, bounded ``half_open_flood``; ``python -m
tests.store.handshake_flood [halfopen|job] [--runs N] [--pause S] [--pin]`` prints the figures of
docs/security.md. Only loopback traffic; every server, socket and process is closed at the end.
"""

from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Dict, List, Optional

from distlib.store.tcp import TCPStore
from distlib.store.tcp.security import StoreSecurity
from distlib.subprocesses import stop
from tests.store import flood_probe
from tests.store.flood_probe import Server

#: The attacker's bound in time: it stops opening and closes everything after this long.
MAX_FLOOD_S = 60.0


class HalfOpen(threading.Thread):
    """Holds ``conns`` connections to 127.0.0.1:``port`` that read nothing and answer nothing,
    opening a new one for each the server closes, until ``halt()`` (or MAX_FLOOD_S).

    ``pause``: seconds between rounds of re-opening. 0 re-opens at once, as fast as the thread
    goes: a server that keeps at most N strangers of an address closes one for each new one
    beyond N, so this attacker is also a connect storm, which takes CPU from everything on a
    small host. With a pause it holds its connections the way a buggy script would."""

    def __init__(self, port: int, conns: int, pause: float = 0.0):
        super().__init__(daemon=True, name="half-open-flood")
        self.port = port
        self.conns = conns
        self.pause = pause
        self.opens = 0  # connections opened in all
        self.closed_by_server = 0
        self.failed_opens = 0
        self.held = 0  # connections open now
        self.ready = threading.Event()
        self._halt = threading.Event()
        self._socks: Dict[int, socket.socket] = {}
        self._ep = select.epoll()

    def _open(self) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.settimeout(5)
        try:
            sock.connect(("127.0.0.1", self.port))
        except OSError:
            sock.close()
            self.failed_opens += 1
            return
        self._ep.register(sock.fileno(), select.EPOLLRDHUP)  # (EPOLLHUP and EPOLLERR always)
        self._socks[sock.fileno()] = sock
        self.opens += 1

    def run(self) -> None:
        if flood_probe.PIN is not None:  # this thread only: the attacker on the second CPU
            os.sched_setaffinity(0, flood_probe.PIN[1])
        until = time.monotonic() + MAX_FLOOD_S
        try:
            for _ in range(self.conns):
                self._open()
            self.held = len(self._socks)
            self.ready.set()
            while not self._halt.is_set() and time.monotonic() < until:
                for fd, _ev in self._ep.poll(0.05):
                    sock = self._socks.pop(fd)
                    self._ep.unregister(fd)
                    sock.close()
                    self.closed_by_server += 1
                if self.pause and len(self._socks) < self.conns:
                    self._halt.wait(self.pause)
                for _ in range(self.conns - len(self._socks)):
                    self._open()
                self.held = len(self._socks)
        finally:
            self.ready.set()
            for sock in self._socks.values():
                sock.close()
            self._socks.clear()
            self._ep.close()

    def halt(self) -> None:
        self._halt.set()
        self.join(30)


def _token_holders(server: Server, clients: int, timeout: float, attacker: Optional[HalfOpen]) -> Dict[str, object]:
    """``clients`` token holders connect over TCP one after the other, each set and get a key."""
    times: List[float] = []
    held: List[int] = []
    errors: List[str] = []
    for i in range(clients):
        if attacker is not None:
            held.append(attacker.held)
        started = time.monotonic()
        try:
            store = TCPStore("127.0.0.1", server.port, timeout=timedelta(seconds=timeout),
                             security=StoreSecurity(server.token))
            try:
                store.set(f"k{i}", "v")
                if store.get(f"k{i}") != b"v":
                    errors.append(f"client {i}: get returned something else")
            finally:
                store.close()
        except Exception as exc:  # what a user would see
            errors.append(f"client {i} after {time.monotonic() - started:.2f} s: {exc}")
            continue
        times.append(time.monotonic() - started)
    return {"connect_set_get_s": times, "errors": errors, "half_open_held_min": min(held) if held else None}


def half_open_flood(workdir: Path, conns: int = 600, clients: int = 8, timeout: float = 5.0) -> Dict[str, object]:
    """A token server; ``conns`` half-open connections from 127.0.0.1 held; ``clients`` token
    holders from 127.0.0.1 connecting meanwhile (with ``timeout`` each)."""
    server = Server(workdir, token=True)
    attacker = HalfOpen(server.port, conns)
    try:
        attacker.start()
        attacker.ready.wait(60)
        result = _token_holders(server, clients, timeout, attacker)
        result.update(half_open=conns, opened=attacker.opens, closed_by_server=attacker.closed_by_server,
                      failed_opens=attacker.failed_opens)
    finally:
        attacker.halt()
        server.close()
    log = server.log()
    result["made_room_lines"] = [line for line in log.splitlines() if "made room" in line][:3]
    return result


JOB = textwrap.dedent("""\
    import numpy as np
    import distlib as dist

    dist.init_process_group("gloo")
    x = np.full(4, dist.get_rank() + 1, np.int64)
    dist.all_reduce(x)
    assert x.tolist() == [3, 3, 3, 3], x
    dist.destroy_process_group()
""")


def _job_env(workdir: Path) -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "SLURM_", "TORCHELASTIC_", "MASTER_"))}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "DISTLIB_AUTH_TOKEN", "DISTLIB_RUN_ID", "DISTLIB_INIT_METHOD"):
        env.pop(name, None)
    env.update(DISTLIB_AUTH_TOKEN_FILE=str(workdir / "token"), DISTLIB_STORE_UNIX="0", OMP_NUM_THREADS="1")
    return env


def job_time(workdir: Path, server: Server, run_id: str, timeout: float = 120.0) -> float:
    """Two `distlib-run` launchers (2 nodes, 1 process each, elastic: --max-restarts 1) of a job
    that joins and all-reduces; seconds from their launch to both exiting (RuntimeError when
    one fails)."""
    script = workdir / "job.py"
    script.write_text(JOB)
    env = _job_env(workdir)
    started = time.monotonic()
    procs = [subprocess.Popen([sys.executable, "-m", "distlib.run", "--nnodes", "2", "--nproc-per-node", "1",
                               "--max-restarts", "1", "--node-rank", str(rank), "--rdzv-backend", "c10d",
                               "--rdzv-endpoint", f"127.0.0.1:{server.port}", "--run-id", run_id, str(script)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              preexec_fn=lambda: flood_probe._pin(0))
             for rank in range(2)]
    outputs = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=max(1.0, timeout - (time.monotonic() - started)))
            outputs.append(out)
    finally:
        for proc in procs:
            if proc.poll() is None:
                stop(proc)
    took = time.monotonic() - started
    if any(proc.returncode != 0 for proc in procs):
        raise RuntimeError(f"the job failed (exit {[p.returncode for p in procs]}):\n" + "\n".join(outputs))
    return took


def job_times(workdir: Path, runs: int = 3, conns: int = 600, pause: float = 0.0) -> Dict[str, object]:
    """``runs`` pairs of job times, quiet then under the flood (``HalfOpen``'s ``pause``),
    against one token server."""
    server = Server(workdir, token=True)
    quiet: List[float] = []
    flooded: List[float] = []
    held: List[int] = []
    rates: List[float] = []  # the attacker's new connections a second during each flooded run
    try:
        for i in range(runs):
            quiet.append(job_time(workdir, server, f"quiet-{i}"))
            attacker = HalfOpen(server.port, conns, pause)
            attacker.start()
            attacker.ready.wait(60)
            opens = attacker.opens
            try:
                held.append(attacker.held)
                started = time.monotonic()
                flooded.append(job_time(workdir, server, f"flood-{i}"))
                held.append(attacker.held)
                rates.append((attacker.opens - opens) / (time.monotonic() - started))
            finally:
                attacker.halt()
    finally:
        server.close()
    ratio = sorted(flooded)[len(flooded) // 2] / sorted(quiet)[len(quiet) // 2]
    return {"quiet_s": quiet, "flood_s": flooded, "median_ratio": ratio, "half_open_held_min": min(held),
            "attacker_opens_per_s": rates, "pause": pause}


def main(argv: List[str]) -> int:
    if "--pin" in argv:  # the server and the job on the first CPU, the attacker on the second
        flood_probe.PIN = ({0}, {1})
    which = argv[0] if argv and not argv[0].startswith("-") else "all"
    runs = int(argv[argv.index("--runs") + 1]) if "--runs" in argv else 3
    pause = float(argv[argv.index("--pause") + 1]) if "--pause" in argv else 0.0
    out: Dict[str, object] = {}
    with tempfile.TemporaryDirectory(prefix="distlib-handshake-flood-") as tmp:
        work = Path(tmp)
        if which in ("halfopen", "all"):
            out["halfopen"] = half_open_flood(work, clients=20, timeout=30.0)
        if which in ("job", "all"):
            out["job"] = job_times(work, runs, pause=pause)
    print(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
