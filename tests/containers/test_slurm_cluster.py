"""distlib under a real Slurm 22.05 cluster in containers (tests/support/slurm.py): 2 nodes,
jobs submitted from the controller as the image's user.

* `srun -N2 -n4 python -c 'init_process_group(); all_reduce'`: 4 ranks, nothing set by hand;
* `srun -N2 --ntasks-per-node=1 distlib-run --nproc-per-node 2 ...`: the same 4 ranks;
* a killed task: the others fail and name it, well within the timeout;
* a step cancelled with scancel: the ranks of the other step name the ranks it took;
* a batch script's own process (no srun): the error says to use srun;
* distlib's host list expansion against `scontrol show hostnames`.
"""

from __future__ import annotations

import json
import re
import time

import pytest

from distlib.slurm import hostlist
from distlib.slurm.step import port_for

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(600)]

#: torch's variables: a launcher sets them (distlib-run); under srun nobody does, and init
#: writes none of them (docs/launcher.md#slurm): code asks distlib instead.
TORCH_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")

#: Each task: join through env:// with nothing passed, all_reduce rank+1, say who it is: what
#: distlib says (the identity the group was made with, get_node_local_rank) and os.environ.
ALL_REDUCE = r"""
import json, os, socket, numpy as np, distlib
from datetime import timedelta
from distlib.distributed import get_identity
distlib.init_process_group("gloo", timeout=timedelta(seconds=60))
x = np.array([distlib.get_rank() + 1.0])
distlib.all_reduce(x)
me = get_identity()
who = {"local_rank": distlib.get_node_local_rank(), "local_world_size": me.local_world_size,
       "node_rank": me.node_rank, "master_addr": me.master_addr, "master_port": me.master_port}
env = {k: os.environ.get(k) for k in %r + ("SLURMD_NODENAME", "SLURM_JOB_ID")}
# one write per line: under `python -u` (distlib-run's workers) print() writes the newline apart
os.write(1, ("RESULT " + json.dumps({"rank": distlib.get_rank(), "world": distlib.get_world_size(),
                                     "sum": float(x[0]), "who": who, "env": env}) + "\n").encode())
distlib.destroy_process_group()
""" % (TORCH_NAMES,)

#: Each task: all_reduce in a loop until a peer goes; then say what the error named.
LOOP = r"""
import os, sys, time, numpy as np, distlib
from datetime import timedelta
distlib.init_process_group("gloo", timeout=timedelta(seconds=60))
rank = distlib.get_rank()
os.write(1, f"READY rank {rank} on {os.environ.get('SLURMD_NODENAME')}\n".encode())
x = np.ones(16)
try:
    while True:
        distlib.all_reduce(x)
        time.sleep(0.02)
except Exception as exc:
    os.write(1, f"FAILED rank {rank}: {type(exc).__name__}: {exc}\n".encode())
    sys.exit(3)
"""


def results(output: str):
    found = [json.loads(line.split("RESULT ", 1)[1]) for line in output.splitlines() if "RESULT " in line]
    return sorted(found, key=lambda r: r["rank"])


def test_the_cluster_comes_up_within_a_minute(slurm_cluster):
    assert slurm_cluster.up_s < 60, f"up after {slurm_cluster.up_s:.1f} s"
    code, out = slurm_cluster.exec(["sinfo", "-h", "-N", "-o", "%N %T"])
    assert code == 0 and out.split() == ["node01", "idle", "node02", "idle"], out


def test_srun_python_init_process_group_with_nothing_set_by_hand(slurm_cluster):
    """4 tasks on 2 nodes: each joins through env:// from srun's variables alone; the sum is
    right on every rank, distlib tells each task what torchrun would have set (its local rank,
    the GPU to pick, through get_node_local_rank; the master through get_identity), and
    os.environ stays as srun made it: init writes none of torch's variables."""
    code, out = slurm_cluster.exec(["srun", "-N2", "-n4", "-O", "python", "-c", ALL_REDUCE])
    assert code == 0, out
    got = results(out)
    assert [r["rank"] for r in got] == [0, 1, 2, 3], out
    assert all(r["world"] == 4 and r["sum"] == 10.0 for r in got), got
    job = int(got[0]["env"]["SLURM_JOB_ID"])
    for r in got:
        env = r["env"]
        node = r["rank"] // 2  # block distribution: tasks 0,1 on node01, 2,3 on node02
        assert env["SLURMD_NODENAME"] == f"node0{node + 1}", r
        assert r["who"] == {"local_rank": r["rank"] % 2, "local_world_size": 2, "node_rank": node,
                            "master_addr": "node01", "master_port": port_for(job, 0)}, r
        assert {k: env[k] for k in TORCH_NAMES} == {k: None for k in TORCH_NAMES}, f"os.environ written: {r}"


def test_srun_distlib_run_one_launcher_per_node(slurm_cluster):
    slurm_cluster.write("/shared/all_reduce.py", ALL_REDUCE)
    code, out = slurm_cluster.exec(["srun", "-N2", "--ntasks-per-node=1", "-O", "distlib-run", "--nproc-per-node",
                                    "2", "/shared/all_reduce.py"])
    assert code == 0, out
    got = results(out)
    assert [r["rank"] for r in got] == [0, 1, 2, 3] and all(r["sum"] == 10.0 for r in got), out
    assert [(r["env"]["SLURMD_NODENAME"], r["env"]["LOCAL_RANK"]) for r in got] == [
        ("node01", "0"), ("node01", "1"), ("node02", "0"), ("node02", "1")]
    job = int(got[0]["env"]["SLURM_JOB_ID"])
    assert {r["env"]["MASTER_PORT"] for r in got} == {str(port_for(job, 0))}


def test_dry_run_in_a_step_shows_each_value_and_its_source(slurm_cluster):
    code, out = slurm_cluster.exec(["srun", "-N2", "--ntasks-per-node=1", "-O", "-l", "distlib-run", "--dry-run",
                                    "--nproc-per-node", "2", "train.py"])
    assert code == 0, out
    lines = [line.split(": ", 1)[1] for line in out.splitlines() if line.startswith("1: ")]
    text = "\n".join(lines)
    assert "node-rank        1" in text and "from SLURM_NODEID=1" in text, text
    assert "from SLURM_NNODES=2 (one distlib-run per node)" in text, text
    assert "from the first host of SLURM_STEP_NODELIST=node[01-02]" in text, text
    assert "(20000 + 10 x (SLURM_JOB_ID mod 1000) + (SLURM_STEP_ID mod 10))" in text, text


def test_several_launchers_on_one_node_are_refused_before_starting(slurm_cluster):
    code, out = slurm_cluster.exec(["srun", "-N2", "-n4", "-O", "distlib-run", "--nproc-per-node", "2",
                                    "/shared/all_reduce.py"])
    assert code != 0
    assert "this srun step runs several tasks on a node (SLURM_STEP_TASKS_PER_NODE=2(x2))" in out, out
    assert "RESULT" not in out


def test_a_batch_script_without_srun_is_told_to_use_srun(slurm_cluster):
    slurm_cluster.write("/shared/no_srun.sbatch", "#!/bin/bash\npython -c 'import distlib; distlib.init_process_group()'\n")
    code, out = slurm_cluster.exec(["sbatch", "-N2", "-n4", "-O", "--wait", "--output=/shared/no_srun.out",
                                    "/shared/no_srun.sbatch"])
    assert code != 0, out
    text = slurm_cluster.read("/shared/no_srun.out")
    assert "environment variable RANK expected, but not set (SLURM_JOB_ID=" in text, text
    assert "is set but this is no srun step" in text, text


def _start_batch(cluster, name: str, script: str) -> str:
    cluster.write(f"/shared/{name}.sbatch", script)
    code, out = cluster.exec(["sbatch", "--parsable", f"--output=/shared/{name}.out", f"/shared/{name}.sbatch"])
    assert code == 0, out
    return out.strip().split(";")[0]


def _wait_output(cluster, name: str, predicate, timeout: float, what: str) -> str:
    deadline = time.monotonic() + timeout
    text = ""
    while time.monotonic() < deadline:
        text = cluster.read(f"/shared/{name}.out") or ""
        if predicate(text):
            return text
        time.sleep(0.25)
    raise AssertionError(f"after {timeout:.0f} s, no {what} in /shared/{name}.out:\n{text}")


def _wait_job_gone(cluster, job: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        code, out = cluster.exec(["squeue", "-h", "-j", job])
        if code == 0 and not out.strip():
            return
        time.sleep(0.25)
    cluster.exec(["scancel", job])
    raise AssertionError(f"job {job} still running after {timeout:.0f} s")


def test_a_killed_task_is_named_by_the_others_within_the_timeout(slurm_cluster):
    """Task 3 (rank 3, on node02) gets SIGKILL, as the OOM killer would send it: ranks 0-2 fail
    naming rank 3, long before their 60 s timeout; srun says task 3 was killed."""
    slurm_cluster.write("/shared/loop.py", LOOP)
    job = _start_batch(slurm_cluster, "kill", "#!/bin/bash\n#SBATCH -N2 -n4 -O\nsrun python -u /shared/loop.py\n")
    _wait_output(slurm_cluster, "kill", lambda t: t.count("READY") == 4, 90, "4 READY lines")
    # the task's process, found by its rank (SLURM_PROCID) among the job user's processes on node02
    find_and_kill = ("for p in $(pgrep -u distlib -f /shared/loop.py); do "
                     "if tr '\\0' '\\n' </proc/$p/environ | grep -qx SLURM_PROCID=3; then kill -KILL $p; echo $p; fi; "
                     "done")
    killed_at = time.monotonic()
    code, out = slurm_cluster.exec(["sh", "-c", find_and_kill], container=slurm_cluster.node("node02"))
    assert code == 0 and out.strip(), f"no process of task 3 on node02: {out}"
    text = _wait_output(slurm_cluster, "kill", lambda t: t.count("FAILED rank") == 3, 45, "3 FAILED lines")
    assert time.monotonic() - killed_at < 45
    failed = [line for line in text.splitlines() if line.startswith("FAILED rank")]
    assert sorted(line.split(":")[0] for line in failed) == ["FAILED rank 0", "FAILED rank 1", "FAILED rank 2"]
    assert all("rank 3" in line and "died, was killed" in line for line in failed), failed
    _wait_job_gone(slurm_cluster, job, 60)
    final = slurm_cluster.read("/shared/kill.out")
    assert "srun: error: node02: task 3: Killed" in final, final


def test_a_step_cancelled_with_scancel_is_named_by_the_other_steps_ranks(slurm_cluster):
    """One distlib-run per node, each its own step of the job (the node ranks and the master
    given as flags, which win over Slurm's); `scancel <job>.<step>` of node02's step: the ranks
    of node01 name ranks 2 and 3, which that step ran."""
    slurm_cluster.write("/shared/loop.py", LOOP)
    flags = "--nnodes 2 --nproc-per-node 2 --master-addr node01 --master-port 29400"
    script = ("#!/bin/bash\n#SBATCH -N2 -O\n"
              f"srun -N1 -n1 -w node01 distlib-run {flags} --node-rank 0 /shared/loop.py &\n"
              f"srun -N1 -n1 -w node02 distlib-run {flags} --node-rank 1 /shared/loop.py &\n"
              "wait\n")
    job = _start_batch(slurm_cluster, "scancel", script)
    _wait_output(slurm_cluster, "scancel", lambda t: t.count("READY") == 4, 90, "4 READY lines")
    steps = dict((nodes, step) for step, nodes in slurm_cluster.squeue_steps() if step.startswith(f"{job}."))
    assert "node02" in steps, steps
    code, out = slurm_cluster.exec(["scancel", steps["node02"]])
    assert code == 0, out
    text = _wait_output(slurm_cluster, "scancel", lambda t: t.count("FAILED rank") >= 2, 45,
                        "the FAILED lines of ranks 0 and 1")
    # distlib-run prefixes each worker's line with "[rankN]: ", as torchrun does
    failed = [line for line in text.splitlines() if re.match(r"(\[rank[01]\]: )?FAILED rank [01]:", line)]
    assert len(failed) == 2, text
    assert all("rank 2" in line or "rank 3" in line for line in failed), failed
    _wait_job_gone(slurm_cluster, job, 60)


# -- host lists: distlib against scontrol --------------------------------------------------------

#: Forms Slurm expands; distlib must give the same names in the same order.
VALID = ["node1", "node[1-3]", "node[01-10]", "node[1-010]", "node[001-3],x", "node[08-11]", "node[1-3,5,7-8]",
         "r[1-2]n[01-02]", "n[1-2]-[3-4]", "x[1-2]y[3-4]z[5-6]", "a[1-2]b[3-5]c[6-7]", "a[1-2]b[3-4]c[5-6]d[7-8]",
         "gpu-[1-2],a-b[7]", "[1-2]", "node2,node1,node2", "node[1-2],", "node1 node2", "n[0000-0150]",
         "p[1-2]q[3-4],z[1-2]w[1-2]x[1-2]"]
#: Forms Slurm calls invalid; distlib must refuse them too.
INVALID = ["node[]", "node[3-1]", "node[a-b]", "node[[1-2]]", "node[1-2-3]", "node[-1]", "node[1-70000]",
           "node[1,,2]", "b[2-3]-ib", "b[2-3]ib", "n[1-2]x[1-2]-z"]


def test_hostlist_expansion_matches_scontrol(slurm_cluster):
    for form in VALID:
        code, out = slurm_cluster.exec(["scontrol", "show", "hostnames", form])
        assert code == 0, f"{form}: {out}"
        assert hostlist.expand(form) == out.split(), form
    for form in INVALID:
        code, out = slurm_cluster.exec(["scontrol", "show", "hostnames", form])
        assert code != 0 or "Invalid hostlist" in out, f"{form}: Slurm accepted it: {out}"
        with pytest.raises(hostlist.HostlistError):
            hostlist.expand(form)
