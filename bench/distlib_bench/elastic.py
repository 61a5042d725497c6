"""``distlib bench elastic``: how long an elastic job is without training after a node is lost
or a worker crashes — from the loss (SIGKILL of the node's agent and its workers, or the
worker's exit) to the first collective of the next round — for distlib-run and, side by side,
torchrun doing the same.

    distlib bench elastic [--runs 5] [--cases node-loss,worker-crash]
                          [--launchers distlib,torchrun,distlib-containers]
                          [--torch-python PATH] [--image distlib:cpu] [--json]

Every launcher runs the same worker (this module with ``--worker``, distlib's gloo group over
the launcher's store), so only the launchers differ. Three nodes, ``--nnodes 2:3``,
``--max-restarts 3``, each launcher's own defaults for everything else (heartbeats, last call):
what a user gets. Host processes on this machine for both launchers (torchrun's c10d store in
its first agent, distlib's in a `distlib store-server`; the ranks talk over TCP, DISTLIB_SHM=0,
as they would between hosts); ``distlib-containers``: the same
distlib run with each node in its own container (needs Docker and the image). The loss is
timed on the host clock, which the containers share; the next round's first collective is the
earliest any surviving rank reports. Results: docs/launcher.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

from .children import child_pythonpath

PREFIX = "elastic-bench:"
NODES = 3
REPO = Path(__file__).resolve().parents[2]
DEFAULT_TORCH_PYTHON = Path.home() / ".cache" / "distlib" / "torch-2.13" / "bin" / "python"


# -- the worker ---------------------------------------------------------------------------------------------


def worker(out: Optional[str], crash_rank: int, crash_after: float, seconds: float) -> int:
    """Join the round's group, report the first collective's time, all_reduce until ``seconds``."""
    import numpy as np

    import distlib as dist
    from distlib_deploy.jobs import _common

    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    _common.join("gloo", 60.0)
    rank = dist.get_rank()
    x = np.ones(1024, np.float32)
    dist.all_reduce(x)
    first = time.time()
    report(out, f"first-{restart}-{rank}", first)
    started = time.monotonic()
    while time.monotonic() - started < seconds:
        if restart == 0 and rank == crash_rank and time.monotonic() - started >= crash_after:
            report(out, "crash", time.time())
            os._exit(3)
        x[:] = 1
        dist.all_reduce(x)
        time.sleep(0.02)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def report(out: Optional[str], name: str, when: float) -> None:
    print(f"{PREFIX} {name} unix {when:.3f}", flush=True)
    if out:
        path = Path(out) / name
        path.with_suffix(".tmp").write_text(f"{when:.6f}")
        os.replace(path.with_suffix(".tmp"), path)


# -- host processes -------------------------------------------------------------------------------------------


def _free_port() -> int:
    from distlib.store_service import free_port

    return free_port()


class HostRun:
    """One run of three agents as host processes; a node's loss kills its whole process tree."""

    def __init__(self, launcher: str, torch_python: str, case: str, workdir: Path):
        self.launcher, self.case, self.dir = launcher, case, workdir
        self.out = workdir / "out"
        self.out.mkdir(parents=True)
        self.agents: List[subprocess.Popen] = []
        self.server = None
        port = _free_port()
        rid = f"bench-{os.getpid()}-{int(time.time() * 1000) % 10**8}"
        job = ["-m", "distlib_bench.elastic", "--worker", "--out", str(self.out), "--seconds", "25"]
        if case == "worker-crash":
            job += ["--crash-rank", "1", "--crash-after", "2"]
        if launcher == "distlib":
            from distlib.store_service import StoreServerProcess

            self.server = StoreServerProcess("127.0.0.1").start()
            port = self.server.port
            cmd = [sys.executable, "-m", "distlib.run", "--log-level", "WARNING"]
            rdzv = ["--run-id", rid]
        else:
            cmd = [torch_python, "-m", "torch.distributed.run"]
            rdzv = ["--rdzv-id", rid]
        self.port = port
        self.cmd = cmd + ["--nnodes", f"2:{NODES}", "--nproc-per-node", "1", "--max-restarts", "3",
                          "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", *rdzv, *job]
        self.env = dict(os.environ, PYTHONPATH=child_pythonpath(os.environ.get("PYTHONPATH", "")),
                        OMP_NUM_THREADS="1", LOGLEVEL=os.environ.get("LOGLEVEL", "INFO"),
                        # ranks talk over TCP, as on separate hosts: a killed peer's sockets are
                        # closed by the kernel at once (shared memory would wait for the timeout)
                        DISTLIB_SHM="0")
        for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "DISTLIB_INIT_METHOD",
                    "TORCHELASTIC_RUN_ID", "DISTLIB_RUN_ID"):
            self.env.pop(var, None)

    def start(self) -> None:
        for i in range(NODES):
            log = open(self.dir / f"agent{i}.log", "w")
            self.agents.append(subprocess.Popen(self.cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                                start_new_session=True, cwd=str(REPO)))
            if i == 0 and self.launcher == "torchrun":
                # the first agent hosts torchrun's c10d store: it must be listening before the
                # others start, or one of them may host it (and the node lost might take it along)
                _wait(lambda: _listening(self.port), 120, "torchrun's store on the first agent", self)

    def lose(self) -> float:
        """The loss: node 2 (not the store's host) killed with its workers, or the crash's time."""
        if self.case == "node-loss":
            victims = descendants(self.agents[2].pid)  # torchrun's workers outlive their agent
            when = time.time()
            for pid in [self.agents[2].pid] + victims:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            return when
        _wait(lambda: (self.out / "crash").exists(), 60, "the worker's crash", self)
        return float((self.out / "crash").read_text())

    def stop(self) -> None:
        for proc in self.agents:
            for pid in [proc.pid] + descendants(proc.pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            proc.wait(10)
        if self.server is not None:
            self.server.stop()

    def logs(self) -> str:
        return "\n".join((self.dir / f"agent{i}.log").read_text()[-4000:] for i in range(len(self.agents)))


def _listening(port: int) -> bool:
    import socket

    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def descendants(pid: int) -> List[int]:
    """Every process below ``pid`` (from /proc): a node's whole tree, whatever sessions it made."""
    parents: Dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    found, frontier = [], [pid]
    while frontier:
        kids = [p for p, parent in parents.items() if parent in frontier]
        found += kids
        frontier = kids
    return found


def _wait(ready: Callable[[], object], timeout: float, what: str, run) -> None:
    """Until ``ready()`` is true (a non-empty list counts); RuntimeError with ``run``'s logs after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            raise RuntimeError(f"no {what} within {timeout:.0f} s:\n{run.logs()}")
        time.sleep(0.05)


def firsts(out: Path, restart: int) -> List[float]:
    return [float(p.read_text()) for p in out.glob(f"first-{restart}-*")]


def host_once(launcher: str, torch_python: str, case: str) -> float:
    workdir = Path(tempfile.mkdtemp(prefix="distlib-bench-elastic-"))
    run = HostRun(launcher, torch_python, case, workdir)
    try:
        run.start()
        _wait(lambda: len(firsts(run.out, 0)) >= NODES, 120, "round 0 on every node", run)
        time.sleep(1.0)
        lost = run.lose()
        _wait(lambda: firsts(run.out, 1), 180, "the next round's first collective", run)
        return min(firsts(run.out, 1)) - lost
    finally:
        run.stop()
        shutil.rmtree(workdir, ignore_errors=True)


# -- containers (distlib) --------------------------------------------------------------------------------------


def container_once(image: str, case: str) -> float:
    import docker

    client = docker.from_env()
    labels = {"org.distlib.bench": "elastic", "org.distlib.bench.pid": str(os.getpid())}
    net = client.networks.create(f"distlib-bench-elastic-{os.getpid()}-{int(time.time())}", internal=True,
                                 labels=labels)
    made = []
    try:
        made.append(client.containers.run(image, ["distlib", "store-server", "--host", "0.0.0.0", "--port", "29500"],
                                          detach=True, network=net.name, name=f"{net.name}-master", hostname="master",
                                          labels=labels))
        net.disconnect(made[0])
        net.connect(made[0], aliases=["master"])
        job = ["--seconds", "25"] + (["--crash-rank", "1", "--crash-after", "2"] if case == "worker-crash" else [])
        cmd = ["distlib-run", "--log-level", "WARNING", "--nnodes", f"2:{NODES}", "--max-restarts", "3",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", "master:29500", "--run-id", "bench",
               "-m", "distlib_bench.elastic", "--worker", *job]
        nodes = [client.containers.run(image, cmd, detach=True, network=net.name, name=f"{net.name}-node{i}",
                                       environment={"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "eth0"},
                                       labels=labels) for i in range(NODES)]
        made += nodes

        def times(name: str) -> List[float]:
            found = []
            for node in nodes:
                for line in node.logs().decode("utf-8", "replace").splitlines():
                    if f"{PREFIX} {name}" in line:
                        found.append(float(line.rsplit(" ", 1)[1]))
            return found

        class Logs:
            def logs(self) -> str:
                return "\n".join(n.logs().decode("utf-8", "replace")[-1500:] for n in nodes)

        _wait(lambda: len(times("first-0-")) >= NODES, 180, "round 0 on every node", Logs())
        time.sleep(1.0)
        if case == "node-loss":
            lost = time.time()
            nodes[2].kill()
        else:
            _wait(lambda: times("crash"), 60, "the worker's crash", Logs())
            lost = times("crash")[0]
        _wait(lambda: times("first-1-"), 180, "the next round's first collective", Logs())
        return min(times("first-1-")) - lost
    finally:
        for ctr in made:
            try:
                ctr.remove(force=True)
            except docker.errors.APIError:
                pass
        net.remove()


# -- the command --------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="distlib bench elastic", description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=5, help="runs per launcher and case (default 5)")
    p.add_argument("--cases", default="node-loss,worker-crash")
    p.add_argument("--launchers", default="distlib,torchrun",
                   help="distlib, torchrun, distlib-containers (comma-separated; default distlib,torchrun)")
    p.add_argument("--torch-python", default=str(DEFAULT_TORCH_PYTHON),
                   help=f"a Python with torch for torchrun (default {DEFAULT_TORCH_PYTHON}, make test-interop's)")
    p.add_argument("--image", default="distlib:cpu", help="the image of distlib-containers (default distlib:cpu)")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--crash-rank", type=int, default=-1, help=argparse.SUPPRESS)
    p.add_argument("--crash-after", type=float, default=2.0, help=argparse.SUPPRESS)
    p.add_argument("--seconds", type=float, default=25.0, help=argparse.SUPPRESS)
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.worker:
        return worker(args.out, args.crash_rank, args.crash_after, args.seconds)
    launchers = [x.strip() for x in args.launchers.split(",") if x.strip()]
    if "torchrun" in launchers and not Path(args.torch_python).exists():
        print(f"distlib bench elastic: no torch at {args.torch_python} (make test-interop installs it): torchrun "
              "left out", file=sys.stderr)
        launchers.remove("torchrun")
    results: Dict[str, Dict[str, List[float]]] = {}
    for case in [c.strip() for c in args.cases.split(",") if c.strip()]:
        for launcher in launchers:
            times = []
            for i in range(args.runs):
                took = (container_once(args.image, case) if launcher == "distlib-containers"
                        else host_once(launcher, args.torch_python, case))
                times.append(took)
                print(f"{case:12} {launcher:18} run {i + 1}/{args.runs}: {took:6.2f} s", file=sys.stderr, flush=True)
            results.setdefault(case, {})[launcher] = times
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    print(f"{'case':12}  {'launcher':18}  {'median':>7}  {'min':>7}  {'max':>7}  runs")
    for case, by in results.items():
        for launcher, times in by.items():
            print(f"{case:12}  {launcher:18}  {statistics.median(times):6.2f}s  {min(times):6.2f}s  "
                  f"{max(times):6.2f}s  {len(times)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
