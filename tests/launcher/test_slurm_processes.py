"""Both Slurm launch shapes with real processes on this machine, srun's variables given by hand.

`srun python train.py` (one task per rank: init_process_group's env:// reads Slurm's variables)
and `srun --ntasks-per-node=1 distlib-run --nproc-per-node N train.py` (one launcher per
node), each with the environment srun gives its tasks, the node list naming this machine.
The real srun on a real Slurm cluster: tests/containers/test_slurm_cluster.py.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
from typing import Dict, List

import pytest

from distlib.slurm.step import port_for
from tests.launcher.conftest import clean_env, launcher_cmd

pytestmark = pytest.mark.timeout(120)

#: torch's variables torchrun would have set, which env:// reads from Slurm's in an srun step.
TORCH_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
               "TORCHELASTIC_RUN_ID")

#: A task's job: join the default group through env:// (nothing passed), all_reduce, and say
#: what it was told: the identity its group was made with, the job report's rendezvous line, and
#: os.environ's torch variables afterwards.
JOB = """
import json, os, numpy as np, distlib
from distlib.distributed import get_identity
from distlib_deploy.jobs._common import describe_init
distlib.init_process_group("gloo", timeout=__import__("datetime").timedelta(seconds=40))
x = np.array([distlib.get_rank() + 1.0])
distlib.all_reduce(x)
me = get_identity()
identity = {"rank": me.rank, "world_size": me.world_size, "local_rank": me.local_rank,
            "local_world_size": me.local_world_size, "node_rank": me.node_rank, "master_addr": me.master_addr,
            "master_port": me.master_port, "run_id": me.run_id}
seen = {k: os.environ.get(k) for k in %r}
print("RESULT " + json.dumps({"rank": distlib.get_rank(), "world": distlib.get_world_size(), "sum": float(x[0]),
                              "local": distlib.get_node_local_rank(), "identity": identity, "env": seen,
                              "report": describe_init("env://")}), flush=True)
distlib.destroy_process_group()
""" % (TORCH_NAMES,)


def free_slurm_job_id() -> int:
    """A job id whose port (the Slurm port rule) is free on 127.0.0.1 now."""
    for job in range(7000, 8000):
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port_for(job, 0)))
            except OSError:
                continue
            return job
    pytest.skip("no port of the Slurm rule is free here")


def task_env(job: int, procid: int, ntasks: int, nodeid: int, nnodes: int, tasks_per_node: str,
             localid: int, nodelist: str, **extra: str) -> Dict[str, str]:
    env = clean_env(SLURM_JOB_ID=str(job), SLURM_STEP_ID="0", SLURM_PROCID=str(procid), SLURM_NTASKS=str(ntasks),
                    SLURM_NPROCS=str(ntasks), SLURM_NODEID=str(nodeid), SLURM_NNODES=str(nnodes),
                    SLURM_LOCALID=str(localid), SLURM_STEP_TASKS_PER_NODE=tasks_per_node,
                    SLURM_TASKS_PER_NODE=tasks_per_node, SLURM_STEP_NODELIST=nodelist, SLURM_JOB_NODELIST=nodelist,
                    DISTLIB_LOG_LEVEL="INFO", **extra)
    return env


def results(procs: List[subprocess.Popen], timeout: float = 90) -> List[dict]:
    found, outputs = [], []
    deadline = time.monotonic() + timeout
    for proc in procs:
        out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        outputs.append((proc.returncode, out, err))
    for code, out, err in outputs:
        assert code == 0, f"exit {code}\n{out}\n{err}"
        # under distlib-run each worker line carries its rank in front ("[rank3]: RESULT ...")
        found += [json.loads(m.group(1)) for m in re.finditer(r"^(?:\[rank\d+\]: )?RESULT (.*)$", out, re.M)]
    return sorted(found, key=lambda r: r["rank"])


def test_srun_python_shape_env_init_with_nothing_set_by_hand():
    """4 tasks on 2 "nodes" (both this machine, node list `localhost,localhost`), as srun -N2 -n4
    starts them: every rank joins, the all_reduce is right, each task's identity is what
    torchrun would have told it (local ranks 0,1,0,1; the first host and the job's port), the
    train_dp report names that master, and os.environ is left as srun made it (distlib writes
    none of torch's variables)."""
    job = free_slurm_job_id()
    layout = [(0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1)]  # (procid, nodeid, localid): block distribution
    procs = [subprocess.Popen([sys.executable, "-c", JOB], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=task_env(job, p, 4, n, 2, "2(x2)", local, "localhost,localhost"))
             for p, n, local in layout]
    got = results(procs)
    assert [r["rank"] for r in got] == [0, 1, 2, 3]
    assert all(r["world"] == 4 and r["sum"] == 10.0 for r in got), got
    port = str(port_for(job, 0))
    for (procid, nodeid, localid), r in zip(layout, got, strict=True):
        assert r["identity"] == {"rank": procid, "world_size": 4, "local_rank": localid, "local_world_size": 2,
                                 "node_rank": nodeid, "master_addr": "localhost", "master_port": int(port),
                                 "run_id": f"slurm-{job}.0"}, r
        assert r["local"] == localid, r
        assert r["env"] == {name: None for name in TORCH_NAMES}, f"rank {procid} had os.environ written: {r}"
        assert r["report"] == f"env:// with rank 0 hosting the store at localhost:{port}", r


def test_srun_python_shape_says_where_each_value_came_from():
    job = free_slurm_job_id()
    proc = subprocess.run([sys.executable, "-c", JOB], capture_output=True, text=True, timeout=60,
                          env=task_env(job, 0, 1, 0, 1, "1", 0, "localhost", DISTLIB_DEBUG="INFO"))
    assert proc.returncode == 0, proc.stderr
    assert f"[rank0] INFO distlib.rendezvous: env:// inside Slurm step {job}.0: RANK=0 (from SLURM_PROCID=0), WORLD_SIZE=1 (from SLURM_NTASKS=1), " \
           f"MASTER_ADDR=localhost (from the first host of SLURM_STEP_NODELIST=localhost), " \
           f"MASTER_PORT={port_for(job, 0)} (from SLURM_JOB_ID={job}, SLURM_STEP_ID=0" in proc.stderr, proc.stderr


def test_contradicting_slurm_variables_fail_before_any_wait():
    """SLURM_PROCID=4 of SLURM_NTASKS=4: the error names both, at once (a rank that waited
    would sit out the 40 s timeout)."""
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", JOB], capture_output=True, text=True, timeout=60,
                          env=task_env(free_slurm_job_id(), 4, 4, 1, 2, "2(x2)", 1, "localhost,localhost"))
    assert proc.returncode != 0
    assert ("Error initializing torch.distributed using env:// rendezvous: SLURM_PROCID=4 is not below "
            "SLURM_NTASKS=4: task ranks go from 0 to 3 (Slurm's variables of this srun task)") in proc.stderr, \
        proc.stderr
    assert time.monotonic() - started < 30, "it waited on the network first"


def test_a_batch_script_without_srun_is_told_to_use_it():
    env = clean_env(SLURM_JOB_ID="99", SLURM_NTASKS="4", SLURM_JOB_NODELIST="node[1-2]")
    proc = subprocess.run([sys.executable, "-c", JOB], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode != 0
    assert "environment variable RANK expected, but not set (SLURM_JOB_ID=99 is set but this is no srun step" \
        in proc.stderr, proc.stderr


def test_srun_distlib_run_shape_one_launcher_per_node(tmp_path):
    """`srun -N2 --ntasks-per-node=1 distlib-run --nproc-per-node 2`: two launchers, told only
    Slurm's variables, make 4 ranks in node order."""
    job = free_slurm_job_id()
    script = tmp_path / "train.py"
    script.write_text(JOB)
    procs = [subprocess.Popen(launcher_cmd("--nproc-per-node", "2", str(script)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=task_env(job, node, 2, node, 2, "1(x2)", 0, "localhost,localhost"))
             for node in (0, 1)]
    got = results(procs)
    assert [r["rank"] for r in got] == [0, 1, 2, 3] and all(r["sum"] == 10.0 for r in got), got
    assert [(r["env"]["LOCAL_RANK"], r["env"]["GROUP_RANK"]) for r in got] == [("0", "0"), ("1", "0"),
                                                                                ("0", "1"), ("1", "1")]
    assert {r["env"]["MASTER_PORT"] for r in got} == {str(port_for(job, 0))}
    assert {r["env"]["TORCHELASTIC_RUN_ID"] for r in got} == {f"slurm-{job}.0"}  # distlib-run's run id
