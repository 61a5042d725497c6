"""The elastic launcher's process tests' shared parts: a job of several agents (``Job``), each a
real ``distlib-run`` process running tests/launcher/elastic_worker.py, and what their logs say.
The fixtures that make them are in conftest.py (``make_job``, ``endpoint``, ``tcp_endpoint``)."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Dict, List, Optional

from distlib.launcher import rounds as R
from distlib.launcher.rounds_store import RoundStore
from distlib.store.file import FileStore
from distlib.store.tcp.client import TCPStore

from .conftest import clean_env, launcher_cmd, wait_for

WORKER = str(Path(__file__).with_name("elastic_worker.py"))
# a 2 s heartbeat bound; the last call (3 s) outlasts it, as the defaults do (30 s > 10 s), so a
# restart round learns that a silent node is lost before it closes without it
FAST = "keep_alive_interval=0.5,keep_alive_max_attempt=4,last_call_timeout=3,join_timeout=30"


class Job:
    """Agents of one elastic run; their output in files; everything killed at the end."""

    def __init__(self, tmp: Path, endpoint: str, run_id: str, nnodes: str, max_restarts: int,
                 conf: str = FAST, **env: str):
        self.tmp = tmp
        self.out = tmp / "out"
        self.mark = tmp / "mark"
        self.out.mkdir(exist_ok=True)
        self.mark.mkdir(exist_ok=True)
        self.args = ["--nnodes", nnodes, "--max-restarts", str(max_restarts), "--rdzv-backend", "c10d",
                     "--rdzv-endpoint", endpoint, "--run-id", run_id, "--rdzv-conf", conf, "--grace-period", "2",
                     "--monitor-interval", "0.05"]
        self.endpoint = endpoint
        self.run_id = run_id
        self.env = clean_env(EW_OUT=str(self.out), EW_MARK=str(self.mark), **env)
        self.agents: List[subprocess.Popen] = []
        self.logs: List[Path] = []

    def start(self, count: int = 1, **env: str) -> List[subprocess.Popen]:
        started = []
        for _ in range(count):
            i = len(self.agents)
            log = self.tmp / f"agent{i}.log"
            with open(log, "w") as f:
                proc = subprocess.Popen(launcher_cmd(*self.args, WORKER), env={**self.env, **env}, stdout=f,
                                        stderr=subprocess.STDOUT)
            self.agents.append(proc)
            self.logs.append(log)
            started.append(proc)
        return started

    def log(self, agent) -> str:
        return self.logs[self.agents.index(agent)].read_text()

    def wait(self, agents=None, timeout: float = 90) -> Dict[int, int]:
        codes = {}
        for proc in agents or self.agents:
            try:
                codes[proc.pid] = proc.wait(timeout)
            except subprocess.TimeoutExpired:
                raise AssertionError(f"agent {proc.pid} still running after {timeout} s:\n{self.log(proc)[-3000:]}") from None
        return codes

    def started(self, round_: int, count: int, timeout: float = 60) -> Dict[int, int]:
        """{global rank: agent pid} once ``count`` workers of ``round_`` ran their first all_reduce."""
        def marks():  # a worker writes started-R-N.tmp, then renames it: only whole marks count
            return [p for p in self.mark.glob(f"started-{round_}-*") if not p.name.endswith(".tmp")]

        try:
            wait_for(lambda: len(marks()) >= count, timeout, f"{count} workers of round {round_}")
        except AssertionError:
            raise AssertionError("\n".join(self.log(a)[-1500:] for a in self.agents)) from None
        return {int(p.name.rsplit("-", 1)[1]): int(p.read_text()) for p in marks()}

    def records(self, round_: int) -> Dict[int, dict]:
        return {int(p.stem.split("-")[1]): json.loads(p.read_text()) for p in self.out.glob(f"{round_}-*.json")}

    def state(self) -> Optional[R.JobState]:
        if self.endpoint.startswith("file://"):
            connect = lambda _s: FileStore(self.endpoint[len("file://"):])  # noqa: E731
        else:
            host, port = self.endpoint.split(":")
            connect = lambda s: TCPStore(host, int(port), None, False, s)  # noqa: E731
        rounds = RoundStore(connect, self.run_id, 5.0, 10.0)
        try:
            return rounds.read()[1]
        finally:
            rounds.close()

    def agent_of(self, pid: int) -> subprocess.Popen:
        return next(a for a in self.agents if a.pid == pid)

    def kill_all(self) -> None:
        for proc in self.agents:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


def round_lines(text: str) -> List[str]:
    """An agent's lines for the rounds after the first (each round's one line)."""
    return re.findall(r"^distlib-run: (round [1-9]\d* \(restart .*)$", text, re.M)
