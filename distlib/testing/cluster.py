"""A cluster of hosts that runs a job under a fault schedule and returns every rank's record.

The cluster owns what is the same in every substrate: the run directory (the socket the ranks
report to, their stack files, the hosts file, the shared directory), the master service, the
schedule's thread, the deadline and its report, the cleanup, and the records. The substrate
(processes.py, containers.py) only makes hosts and acts on them.
"""

from __future__ import annotations

import contextlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
import logging
import os
import pickle
import re
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence, Union

from .channel import Channel, unix_path_ok
from .events import Event, EventLog
from .faults import host_name
from .hang import hang_report
from .job import MASTER_PORT, Job
from .names import HostsFile
from .record import Result
from .assemble import build_result
from .schedule import Schedule, StepLike
from .settings import NODE, RUN_DIR, SHARED, SOCKET, STACKS
from .substrate import ABILITIES, Host, Substrate

log = logging.getLogger("distlib.testing")

DEFAULT_DEADLINE_S = 300.0
#: how long the master service has to say it listens (a loaded CI machine starts Python slowly)
MASTER_START_S = 60.0


class Unsupported(Exception):
    """The substrate cannot carry out this schedule (the message says which fault and why)."""


class Cluster:
    """``nodes`` hosts (node0..node<N-1>) and a master host, on ``substrate``.

    ``project_dir`` is the user's directory: the job's working directory on every host, at the
    same path (containers mount it). ``run(job, schedule, deadline)`` runs a job once and
    returns its ``Result``; the cluster can run several jobs (each starts fresh processes).
    """

    def __init__(self, substrate: Substrate, nodes: int, run_dir: str, project_dir: Optional[str] = None):
        if nodes < 1:
            raise ValueError(f"a cluster needs at least 1 node, not {nodes}")
        self.substrate = substrate
        self.nodes = nodes
        self.run_dir = run_dir
        self.project_dir = os.path.abspath(project_dir or os.getcwd())
        self.names = [f"node{i}" for i in range(nodes)]
        self.results: List[Result] = []
        self.schedules: List[Schedule] = []
        #: a schedule that replaces the one each run is given (--distlib-replay, shrinking)
        self.replay: Optional[Schedule] = None
        self._runs = 0

    # --- running ---------------------------------------------------------------------------------

    def check(self, schedule: Schedule) -> None:
        """Unsupported when the substrate lacks what a fault of ``schedule`` needs."""
        for step in schedule.steps:
            needs = step.fault.requirements()
            for need in [a for a in ABILITIES if a in needs]:
                if need not in self.substrate.abilities:
                    raise Unsupported(f"{step.fault} needs {need}, which the {self.substrate.kind} substrate has "
                                      f"not here: {self.substrate.missing.get(need, 'not offered')}")

    def run(self, job: Job, schedule: Union[Schedule, Iterable[StepLike], None] = None,
            deadline: float = DEFAULT_DEADLINE_S, held: Sequence[Union[int, str]] = (),
            keep_master_state: bool = False) -> Result:
        """Run ``job`` on every node (but the ``held`` ones, which a ``StartNode`` step starts
        later) under ``schedule``, for at most ``deadline`` seconds. ``keep_master_state``: the
        master service journals its keys in a directory of the run's (``distlib store-server
        --state-dir``) and replays them when ``StartMaster``/``RestartMaster`` start it again, as
        a deployed master does; without it, a restarted master comes back empty."""
        plan = self.replay if self.replay is not None else Schedule.of(schedule)
        self.check(plan)
        self.schedules.append(plan)
        self._runs += 1
        run = _Run(self, job, plan, deadline, os.path.join(self.run_dir, f"run-{self._runs}"),
                   [host_name(h) for h in held], keep_master_state)
        result = run.execute()
        self.results.append(result)
        if run.fault_errors:
            raise RuntimeError("a fault could not be carried out: " + "; ".join(run.fault_errors) + "\n" +
                               result.report())
        return result

    def close(self) -> None:
        self.substrate.close()

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Run:
    """One run of a job: hosts started, schedule followed, deadline kept, everything ended."""

    def __init__(self, cluster: Cluster, job: Job, schedule: Schedule, deadline: float, run_dir: str,
                 held: List[str], keep_master_state: bool = False):
        unknown = [h for h in held if h not in cluster.names]
        if unknown:
            raise ValueError(f"held hosts {unknown} are not nodes of this cluster ({', '.join(cluster.names)})")
        self.held = held
        self.started_once: set = set()
        self.cluster = cluster
        self.job = job
        self.schedule = schedule
        self.deadline = deadline
        self.dir = run_dir
        os.makedirs(os.path.join(run_dir, "stacks"), exist_ok=True)
        os.chmod(os.path.join(run_dir, "stacks"), 0o777)
        self.events = EventLog()
        self.hosts: Dict[str, Host] = {}
        self.hosts_file = HostsFile(os.path.join(cluster.run_dir, "hosts"))
        self.faults: List[Dict[str, Any]] = []
        self.fault_errors: List[str] = []
        self.hang: Optional[str] = None
        self._stop = threading.Event()
        self.socket_path = os.path.join(run_dir, "harness.sock")
        too_long = unix_path_ok(self.socket_path)
        if too_long:
            raise ValueError(f"{too_long}: use a shorter run directory")
        self.master_port = MASTER_PORT if "network" in cluster.substrate.abilities else 0
        #: the master's --state-dir (keep_master_state), in the run directory: mounted at the same
        #: path in containers, and kept across the master's restarts; None: no journal
        self.master_state: Optional[str] = os.path.join(run_dir, "master-state") if keep_master_state else None
        if self.master_state:
            os.makedirs(self.master_state, exist_ok=True)
        self._master_argv: List[str] = []
        self._node_argv: List[str] = []
        self._master_addr = ""
        self._armed = 0
        self._schedule_done = not schedule.steps

    # --- the ranks' gates ------------------------------------------------------------------------

    def gates_for(self, hello: Event) -> List[int]:
        gates = {g for step in self.schedule.steps if (g := step.cue.gate(hello)) is not None}
        return sorted(gates)

    def name_peer(self, event: Event) -> Event:
        """A store operation happened on the host whose address sent it (the master reports
        the peer's address); a same-host client (loopback hosts) comes through the server's
        UNIX socket, ``unix (pid N)``: the host of the process that said hello with that pid."""
        if event.kind != "store":
            return event
        peer = str(event.data.get("peer", ""))
        unix = re.search(r"unix \(pid (\d+)\)", peer)
        if unix:
            pid = int(unix.group(1))
            hellos = [e for e in self.events.select("hello") if e.pid == pid and e.node in self.hosts]
            return replace(event, node=hellos[-1].node, rank=hellos[-1].rank) if hellos else event
        address = peer.rsplit(":", 1)[0].strip("[]")
        names = [n for n, h in self.hosts.items() if h.address == address]
        return replace(event, node=names[0]) if len(names) == 1 else event

    # --- start -----------------------------------------------------------------------------------

    def _environment(self, host: str) -> Dict[str, str]:
        paths = self.cluster.substrate.python_paths(host) + [
            p for p in sys.path if p and os.path.abspath(p).startswith(self.cluster.project_dir)]
        if not any(os.path.abspath(p) == self.cluster.project_dir for p in paths):
            paths.append(self.cluster.project_dir)
        inherited = os.environ.get("PYTHONPATH")
        env = {
            "PYTHONPATH": os.pathsep.join(paths + ([inherited] if inherited else [])),
            "PYTHONUNBUFFERED": "1",
            SOCKET: self.socket_path,
            NODE: host,
            STACKS: os.path.join(self.dir, "stacks"),
            RUN_DIR: self.dir,
            SHARED: os.path.join(self.cluster.run_dir, "shared"),
        }
        return env

    def _base_env(self) -> Dict[str, str]:
        if self.cluster.substrate.kind != "processes":
            return {}
        return {k: v for k, v in os.environ.items()
                if not k.startswith(("DISTLIB_TESTING_", "PYTEST_")) and k not in (
                    "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")}

    def on_line(self, host: str, stream: str, line: str) -> None:
        self.events.add("output", host, stream=stream, line=line)

    def _start_master(self) -> str:
        master = self.hosts["master"]
        mark = len(self.events)
        argv = [*self._master_argv, "--port", str(self.master_port)]
        master.start(argv, {**self._base_env(), **self._environment("master")},
                     self.cluster.project_dir, self.on_line)
        limit = time.monotonic() + MASTER_START_S
        while time.monotonic() < limit:
            ready = [e for e in self.events.events(mark) if e.kind == "ready" and e.node == "master"]
            if ready:
                self.master_port = int(ready[0].data["port"])
                return f"master service listening on {master.address}:{self.master_port}"
            if master.poll() is not None:
                break
            self.events.wait_new(len(self.events), 0.1)
        tail = "\n".join(e.data["line"] for e in self.events.events(mark) if e.kind == "output" and e.node == "master")
        raise RuntimeError(f"the master service on {master.address} did not start within {MASTER_START_S:.0f} s "
                           f"(exit status {master.poll()}); its output:\n{tail[-3000:]}")

    def execute(self) -> Result:
        started = time.time()
        substrate = self.cluster.substrate
        channel = Channel(self.socket_path, self.events, self.gates_for, self.name_peer)
        scheduler = threading.Thread(target=self._follow_schedule, name="distlib-testing-schedule", daemon=True)
        try:
            self.job.write_inputs(self.dir)
            self.hosts = substrate.make_hosts(["master"] + self.cluster.names)
            self.hosts_file.set({name: h.address for name, h in self.hosts.items()})
            python = self.job.python or substrate.interpreter()
            listen = "0.0.0.0" if "network" in substrate.abilities else self.hosts["master"].address
            self._master_argv = [python, "-m", "distlib.testing.master", "--socket", self.socket_path, "--host", listen]
            if self.master_state:
                self._master_argv += ["--state-dir", self.master_state]
            self._start_master()
            master_addr = "master" if "names" in substrate.abilities else self.hosts["master"].address
            argv = self.job.argv(python, self.cluster.nodes)
            if self.job.launcher:
                argv = [a.replace(f"master:{MASTER_PORT}", f"{master_addr}:{self.master_port}") for a in argv]
            self._armed = self._leading_steps()
            self._node_argv, self._master_addr = argv, master_addr
            scheduler.start()
            # side by side: a container's create and start are engine calls of ~0.3 s each
            with ThreadPoolExecutor(max_workers=8, thread_name_prefix="distlib-testing-start") as pool:
                for future in [pool.submit(self.start_node, n) for n in self.cluster.names if n not in self.held]:
                    future.result()
            self._wait(started)
        finally:
            self._stop.set()
            self.events.close()
            if scheduler.is_alive():
                scheduler.join(10)
            for host in self.hosts.values():
                with contextlib.suppress(Exception):
                    host.release()
            if any(f["kind"] == "disk" for f in self.faults):
                with contextlib.suppress(Exception):
                    substrate.disk("ok")
            channel.close()
        return build_result(self, started, time.time())

    def start_node(self, name: str) -> str:
        index = self.cluster.names.index(name)
        env = {**self._base_env(), **self.job.host_env(index, self.cluster.nodes, self._master_addr, self.master_port),
               **self._environment(name)}
        again = name in self.started_once
        if again:
            host = self.hosts[name]
            limit = time.monotonic() + 10
            while host.poll() is None and time.monotonic() < limit:
                time.sleep(0.01)
            if host.poll() is None:
                raise RuntimeError(f"{name} is still running: kill it before starting it again")
        self.started_once.add(name)
        self.hosts[name].start(self._node_argv, env, self.cluster.project_dir, self.on_line)
        return f"{'restarted' if again else 'started'} {name}"

    def _wait(self, started: float) -> None:
        limit = started + self.deadline
        while any(self.hosts[n].poll() is None for n in list(self.started_once)) or self._pending_starts():
            if time.time() >= limit:
                self.hang = hang_report(self, self.deadline)
                return
            time.sleep(0.05)

    def _pending_starts(self) -> bool:
        """A held host not started yet while a StartNode step for it is still to come."""
        return any(h not in self.started_once for h in self.held) and not self._schedule_done

    # --- the schedule ----------------------------------------------------------------------------

    def _leading_steps(self) -> int:
        """Steps at ``After(0)`` before any other cue fire before the job starts (a name that
        does not resolve at first, a full disk from the start); returns how many."""
        done = 0
        for step in self.schedule.steps:
            if step.cue.delay != 0:
                break
            self._fire(done, None)
            done += 1
        return done

    def _follow_schedule(self) -> None:
        steps = self.schedule.steps
        armed, armed_at, seen = self._armed, time.time(), 0
        cue = steps[armed].cue.armed() if armed < len(steps) else None
        while not self._stop.is_set():
            if armed >= len(steps):
                self._schedule_done = True
            step = steps[armed] if armed < len(steps) else None
            delay = step.cue.delay if step is not None else None
            if delay is not None:
                left = armed_at + delay - time.time()
                if left <= 0:
                    self._fire(armed, None)
                    armed, armed_at = armed + 1, time.time()
                    cue = steps[armed].cue.armed() if armed < len(steps) else None
                    continue
                wait = min(left, 0.2)
            else:
                wait = 0.2
            new = self.events.wait_new(seen, wait)
            for offset, event in enumerate(new):
                if cue is not None and cue.delay is None and cue.matches(event):
                    self._fire(armed, event)
                    armed, armed_at = armed + 1, time.time()
                    cue = steps[armed].cue.armed() if armed < len(steps) else None
                self.events.mark_seen(seen + offset + 1)
            seen += len(new)
            if self.events.closed and not new:
                return

    def _fire(self, index: int, cue_event: Optional[Event]) -> None:
        step = self.schedule.steps[index]
        fired = time.time()
        try:
            did = step.fault.apply(_Target(self))
        except Exception as exc:  # noqa: BLE001 - recorded, and the run fails with it
            did = f"FAILED: {type(exc).__name__}: {exc}"
            self.fault_errors.append(f"step {index + 1} ({step.fault}): {exc}")
        done = time.time()
        collectives: Dict[int, int] = {}
        for e in self.events.select("collective"):
            collectives[e.rank] = max(collectives.get(e.rank, 0), e.data["n"])
        record = {"step": index + 1, "cue": str(step.cue), "fault": str(step.fault), "kind": step.fault.name,
                  "host": getattr(step.fault, "node", None) and host_name(step.fault.node),  # type: ignore[attr-defined]
                  "t": done, "started": fired, "cue_t": cue_event.t if cue_event else None,
                  "cue_event": cue_event.describe() if cue_event else None, "did": did,
                  "collectives": collectives}
        self.faults.append(record)
        self.events.add("fault", "harness", step=index + 1, fault=str(step.fault), did=did)
        log.info("distlib.testing: step %d at %s: %s", index + 1, step.cue, did)


class _Target:
    """The faults' view of a run (faults.FaultTarget)."""

    def __init__(self, run: _Run):
        self.run = run

    def _host(self, name: str) -> Host:
        try:
            return self.run.hosts[name]
        except KeyError:
            raise ValueError(f"no host {name!r} (hosts: {', '.join(self.run.hosts)})") from None

    def kill_rank(self, rank: int) -> str:
        hellos = [e for e in self.run.events.select("hello") if e.rank == rank]
        if not hellos:
            raise RuntimeError(f"rank {rank} has not started: there is no process to kill")
        last = hellos[-1]
        ok = self._host(last.node).signal_pid(last.pid, signal.SIGKILL)
        return f"SIGKILL to rank {rank} (pid {last.pid} on {last.node})" + ("" if ok else ": it was already gone")

    def kill_node(self, node: str) -> str:
        return self._host(node).kill()

    def start_node(self, node: str) -> str:
        self._host(node)
        return self.run.start_node(node)

    def pause_node(self, node: str) -> str:
        return self._host(node).pause()

    def resume_node(self, node: str) -> str:
        return self._host(node).resume()

    def partition(self, groups: List[List[str]]) -> str:
        addresses = {name: self._host(name).address for group in groups for name in group}
        for group in groups:
            others = [addresses[n] for g in groups if g is not group for n in g]
            for name in group:
                self._host(name).link().block(others)
        return "partitioned " + " | ".join(",".join(g) for g in groups) + " (iptables DROP both ways)"

    def heal(self) -> str:
        for host in self.run.hosts.values():
            with contextlib.suppress(RuntimeError):
                host.link().unblock()
        return "partition healed"

    def degrade_link(self, node: str, delay_ms: float, loss_percent: float) -> str:
        self._host(node).link().degrade(delay_ms, loss_percent)
        return f"{node}'s link: {delay_ms:g} ms delay, {loss_percent:g}% loss"

    def restore_link(self, node: str) -> str:
        self._host(node).link().restore()
        return f"{node}'s link restored"

    def set_resolvable(self, node: str, resolvable: bool) -> str:
        self._host(node)
        self.run.hosts_file.resolvable(node, resolvable)
        return f"{node} {'resolves again' if resolvable else 'no longer resolves'} (hosts file)"

    def disk(self, state: str) -> str:
        return self.run.cluster.substrate.disk(state)

    def kill_master(self) -> str:
        master = self._host("master")
        did = master.kill()
        limit = time.monotonic() + 10
        while master.poll() is None and time.monotonic() < limit:
            time.sleep(0.01)
        return did

    def start_master(self) -> str:
        return self.run._start_master()


def new_run_dir(base: Optional[str] = None) -> str:
    """A short run directory (a UNIX socket path must stay under 108 bytes)."""
    path = tempfile.mkdtemp(prefix="dlt-", dir=base or ("/tmp" if os.path.isdir("/tmp") else None))
    os.chmod(path, 0o755)
    return path


def read_value(run_dir: str, rank: int) -> Any:
    path = Path(run_dir, f"value-{rank}.pkl")
    return pickle.loads(path.read_bytes()) if path.exists() else None


