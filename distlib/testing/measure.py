"""``python -m distlib.testing.measure``: the harness's own figures on this runner
(docs/testing.md): hosts started per second, how close a fault lands to its cue, and a run's
overhead over the same job started by hand.

    python -m distlib.testing.measure [--substrates processes,loopback,containers] [--repeat 5]
                                      [--image distlib:cpu] [--json FILE]

Every figure is the median of ``--repeat`` runs, with the spread (min-max); the runs of the
compared variants alternate.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Tuple

from . import Job, cues, faults, make_cluster

#: a small job: init, STEPS all_reduces, out (written to a temporary directory)
JOB = '''
import os, datetime, numpy as np, distlib as dist
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
x = np.ones(8)
for _ in range(int(os.environ.get("STEPS", "50"))):
    dist.all_reduce(x)
print("line: rank", dist.get_rank(), "done", flush=True)
dist.destroy_process_group()
'''


def spread(values: List[float]) -> Dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _options(substrate: str, image: str) -> Tuple[str, Dict[str, Any]]:
    if substrate == "loopback":
        return "processes", {"namespaces": False}
    if substrate == "containers":
        return "containers", {"image": image}
    return "processes", {}


def startup(substrate: str, hosts: int, repeat: int, image: str, project: str) -> Dict[str, Any]:
    """Time from ``run()`` to every host's Python having said hello (its interpreter up and
    reporting), the master service included; and the cluster's own setup and teardown."""
    kind, options = _options(substrate, image)
    starts, setups, closes = [], [], []
    for _ in range(repeat):
        t0 = time.monotonic()
        cluster = make_cluster(hosts, kind, project_dir=project, **options)
        setups.append(time.monotonic() - t0)
        result = cluster.run(Job(["-c", "pass"]), deadline=300)
        hellos = [e.t for e in result.events if e.kind == "hello" and e.node != "master"]
        if len(hellos) != hosts:
            raise RuntimeError(f"{substrate}: {len(hellos)} of {hosts} hosts said hello:\n{result.report()}")
        starts.append(max(hellos) - result.started)
        t0 = time.monotonic()
        cluster.close()
        closes.append(time.monotonic() - t0)
    return {"hosts": hosts, "start_s": spread(starts), "hosts_per_s": hosts / statistics.median(starts),
            "setup_s": spread(setups), "close_s": spread(closes)}


def landing(substrate: str, repeat: int, image: str, project: str, job_path: str) -> Dict[str, Any]:
    """For each kind of cue: ms from the cue's event (its time in the rank, or at the master)
    to the fault in place, and how many collectives the cued rank entered in between."""
    kind, options = _options(substrate, image)
    plans: Dict[str, Callable[[], Any]] = {
        "collective (held)": lambda: [(cues.Collective(1, 20), faults.KillNode(2))],
        "output line": lambda: [(cues.Output(r"^tick 20$", node="node1"), faults.KillNode(2))],
        "store operation": lambda: [(cues.StoreOp("*join*", op="wait", node="node1"), faults.KillNode(2))],
    }
    out: Dict[str, Any] = {}
    with make_cluster(3, kind, project_dir=project, **options) as cluster:
        for name, plan in plans.items():
            lags, late = [], []
            for _ in range(repeat):
                job = Job.script(job_path, env={"STEPS": "100000", "TICKS": "1"})
                result = cluster.run(job, plan(), deadline=120)
                if not result.faults:
                    raise RuntimeError(f"{substrate}, {name}: the cue never came:\n{result.report()}")
                fault = result.faults[0]
                lags.append((fault["t"] - fault["cue_t"]) * 1e3)
                entered = [e for e in result.events if e.kind == "collective" and e.rank == 1
                           and fault["cue_t"] < e.t <= fault["t"]]
                late.append(float(len(entered)))
            out[name] = {"ms": spread(lags), "collectives_later": spread(late)}
    return out


def overhead(repeat: int, project: str, job_path: str) -> Dict[str, Any]:
    """The same 3-rank job (50 all_reduces) run by hand (a `distlib store-server` and three
    processes with env://) and through the harness (namespaces, and loopback hosts), alternating."""
    by_hand: List[float] = []
    harness_ns: List[float] = []
    harness_lo: List[float] = []
    for _ in range(repeat):
        t0 = time.monotonic()
        _by_hand(job_path, 3)
        by_hand.append(time.monotonic() - t0)
        options: List[Dict[str, Any]] = [{}, {"namespaces": False}]
        for into, kind_options in zip((harness_ns, harness_lo), options, strict=True):
            t0 = time.monotonic()
            with make_cluster(3, "processes", project_dir=project, **kind_options) as cluster:
                cluster.run(Job.script(job_path), deadline=120).assert_ok(world_size=3)
            into.append(time.monotonic() - t0)
    return {"by_hand_s": spread(by_hand), "harness_namespaces_s": spread(harness_ns),
            "harness_loopback_s": spread(harness_lo)}


def _by_hand(job_path: str, world: int) -> None:
    from distlib.store_service import StoreServerProcess

    with StoreServerProcess("127.0.0.1", 0) as master:
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master.port), WORLD_SIZE=str(world),
                   TORCHELASTIC_USE_AGENT_STORE="True")
        procs = [subprocess.Popen([sys.executable, job_path], env={**env, "RANK": str(r)}, stdout=subprocess.DEVNULL)
                 for r in range(world)]
        for p in procs:
            if p.wait(120) != 0:
                raise RuntimeError(f"the job by hand failed (exit {p.returncode})")


def main(argv: List[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m distlib.testing.measure")
    parser.add_argument("--substrates", default="processes,loopback,containers")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--image", default="distlib:cpu")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    project = tempfile.mkdtemp(prefix="dlt-measure-")
    job_path = os.path.join(project, "job.py")
    with open(job_path, "w") as fh:
        fh.write(JOB.replace('    dist.all_reduce(x)\n', '    dist.all_reduce(x)\n    if os.environ.get("TICKS"): '
                                                              'print("tick", _ + 1, flush=True)\n'))
    figures: Dict[str, Any] = {"startup": {}, "landing": {}}
    for substrate in args.substrates.split(","):
        figures["startup"][substrate] = [startup(substrate, n, args.repeat, args.image, project) for n in (3, 8)]
        print(json.dumps({substrate: {"startup": figures["startup"][substrate]}}), flush=True)
        figures["landing"][substrate] = landing(substrate, args.repeat, args.image, project, job_path)
        print(json.dumps({substrate: {"startup": figures["startup"][substrate],
                                      "landing": figures["landing"][substrate]}}, indent=1), flush=True)
    figures["overhead"] = overhead(args.repeat, project, job_path)
    print(json.dumps({"overhead": figures["overhead"]}, indent=1))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(figures, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
