"""The report of a run that passed its deadline: where every process stood, who never came.

Each Python process of the job registered faulthandler on SIGQUIT (the harness's
sitecustomize), writing to its own file in the run directory; the report resumes paused hosts,
sends SIGQUIT to every process that said hello, waits (briefly, bounded) for the files, and
puts them together with the ranks that never arrived, each rank's last collective and each
host's last store operation.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any, Dict, List, Tuple

#: how long the report waits for the stack files (a process that does not answer SIGQUIT is
#: blocked in C code with the GIL held; the report says so)
STACKS_WAIT_S = 5.0
STACK_LINES = 60


def _stack_file(run: Any, node: str, pid: int) -> str:
    return os.path.join(run.dir, "stacks", f"{node}-{pid}.txt")


def hang_report(run: Any, deadline: float) -> str:
    events = run.events.events()
    for host in run.hosts.values():
        try:
            host.resume()
        except Exception:  # noqa: BLE001 - a host that is gone cannot be resumed; the report goes on
            pass
    processes: Dict[Tuple[str, int], int] = {}
    for e in events:
        if e.kind == "hello":
            processes[(e.node, e.pid)] = e.rank
    signalled = [(node, pid) for (node, pid) in processes
                 if node in run.hosts and run.hosts[node].signal_pid(pid, signal.SIGQUIT)]
    limit = time.monotonic() + STACKS_WAIT_S
    while time.monotonic() < limit:
        if all(os.path.exists(_stack_file(run, n, p)) and os.path.getsize(_stack_file(run, n, p)) > 0
               for n, p in signalled):
            break
        time.sleep(0.05)
    time.sleep(0.2)  # the last thread's lines
    lines = [f"distlib.testing: the run passed its deadline of {deadline:g} s; every process it started was ended."]
    lines += _arrivals(run, events)
    for (node, pid) in signalled:
        rank = processes[(node, pid)]
        who = f"rank {rank}" if rank >= 0 else "not a rank"
        path = _stack_file(run, node, pid)
        text = open(path, errors="replace").read() if os.path.exists(path) else ""
        body = text.strip().splitlines()[-STACK_LINES:] if text.strip() else \
            ["(no stack: the process did not answer SIGQUIT within the wait: blocked in C code with the GIL held, "
             "or it replaced the handler)"]
        lines.append(f"--- stacks of {node} pid {pid} ({who}):")
        lines += ["    " + line for line in body]
    return "\n".join(lines)


def _arrivals(run: Any, events: List[Any]) -> List[str]:
    expected = run.job.world_size(run.cluster.nodes)
    hello = {e.rank for e in events if e.kind == "hello" and e.rank >= 0}
    last: Dict[int, Tuple[int, str]] = {}
    for e in events:
        if e.kind == "collective":
            last[e.rank] = (e.data["n"], e.data["op"])
    out = []
    never = [r for r in range(expected) if r not in hello]
    no_collective = [r for r in range(expected) if r in hello and r not in last]
    if never:
        out.append("never arrived (no process with this RANK started): " +
                   ", ".join(f"rank {r}" for r in never))
    if no_collective:
        out.append("started but never entered a collective (stuck in init or before): " +
                   ", ".join(f"rank {r}" for r in no_collective))
    for rank, (n, op) in sorted(last.items()):
        out.append(f"rank {rank}: last entered collective #{n} ({op})")
    stores: Dict[str, Any] = {}
    for e in events:
        if e.kind == "store":
            stores[e.node] = e
    for node, e in sorted(stores.items()):
        out.append(f"{node}: last store operation the master saw: {e.data.get('op')} {e.data.get('keys')} "
                   f"at {time.strftime('%H:%M:%S', time.localtime(e.t))}")
    return out
