"""``MODE=slurm make cluster-up``: a real Slurm cluster in Compose, the job through sbatch/srun.

The Compose files it merges (no engine), the controller's batch script and slurm.conf, which
rank the job's output blames, and two real runs: the default job on 2 nodes x 2 tasks
(report, token, munge key, `down`), and a user's JOB whose rank 1 dies (the exit status and
the rank named).
"""

from __future__ import annotations

import json
import os
import stat

import pytest
import yaml

from distlib_deploy.cluster import engine, slurm
from distlib_deploy.cluster.slurm_node import batch_script, node_names, slurm_conf
from tests.support.cluster_token import check_the_run_used_its_token
from tests.support.compose import (IMPLS, leftovers, need_compose, project_of, read_only_mount, run_cluster,
                                   unhardened)

MUNGE_TARGET = "/run/secrets/distlib/munge.key"


def env_of(service: dict) -> dict:
    env = service["environment"]
    return dict(e.split("=", 1) for e in env) if isinstance(env, list) else env


# -- no engine --------------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", sorted(IMPLS) or ["none"])
def test_compose_files_of_the_slurm_mode(tmp_path, impl):
    need_compose()
    proc = run_cluster("config", tmp_path / "state", compose=IMPLS[impl], MODE="slurm", NODES="3",
                       NPROC_PER_NODE="2")
    assert proc.returncode == 0, proc.stderr
    services = yaml.safe_load(proc.stdout)["services"]
    assert set(services) == {"worker", "slurmctld"}
    worker, ctld = services["worker"], services["slurmctld"]
    assert worker["command"] == ["python", "-m", "distlib_deploy.cluster.slurm_node", "node"]
    assert ctld["command"] == ["python", "-m", "distlib_deploy.cluster.slurm_node", "controller", "--submit"]
    assert worker["image"] == ctld["image"] == "distlib:slurm"
    assert str(worker["user"]) == str(ctld["user"]) == "0" and ctld["hostname"] == "slurmctld"
    # root in the containers, but with only the capabilities slurmd, slurmctld and munged use
    slurm_caps = {"SETUID", "SETGID", "CHOWN", "DAC_OVERRIDE", "FOWNER", "KILL"}
    assert unhardened(services, {"worker": slurm_caps, "slurmctld": slurm_caps}) == []
    key = str(tmp_path / "state" / "distlib-config" / "munge" / "munge.key")
    assert read_only_mount(worker, key, MUNGE_TARGET) and read_only_mount(ctld, key, MUNGE_TARGET)
    env = env_of(ctld)
    assert (str(env["NODES"]), str(env["NPROC_PER_NODE"]), env["JOB_WORKDIR"]) == ("3", "2", "/workspace")
    # AUTH (default on): the controller names the token file, so that sbatch passes it on to the tasks
    assert env["DISTLIB_AUTH_TOKEN_FILE"] == "/run/secrets/distlib/token"
    assert read_only_mount(ctld, str(tmp_path / "state" / "distlib-config" / "auth" / "token"),
                           "/run/secrets/distlib/token")
    assert any("/workspace" in str(v) for v in ctld["volumes"]), "the reports volume: the job's output"


def test_gpu_with_slurm_is_refused_before_anything_starts(tmp_path):
    proc = run_cluster("up", tmp_path / "state", DOCKER_HOST="unix:///nonexistent/docker.sock", MODE="slurm",
                       GPU="1")
    assert proc.returncode == 2 and "GPU=1 with MODE=slurm is not supported" in proc.stderr, proc.stderr


def test_the_batch_script_runs_one_task_per_rank():
    script = batch_script(4, 2, ["-m", "distlib_deploy.jobs.train_dp", "--epochs", "3"], "/job", "/w/slurm-%j.out")
    lines = script.splitlines()
    assert lines[0] == "#!/bin/bash"
    for option in ("--nodes=4", "--ntasks-per-node=2", "--chdir=/job", "--output=/w/slurm-%j.out"):
        assert f"#SBATCH {option}" in lines
    assert lines[-1] == "srun python -u -m distlib_deploy.jobs.train_dp --epochs 3"
    assert not any(word in script for word in ("MASTER_ADDR", "MASTER_PORT", "RANK=")), "nothing set by hand"


def test_slurm_conf_names_the_nodes_and_the_controller():
    names = node_names(12)
    assert names[:2] == ["node01", "node02"] and names[-1] == "node12"
    assert node_names(100)[0] == "node001"
    conf = slurm_conf(names[:3], 2)
    assert "SlurmctldHost=slurmctld" in conf and "AuthType=auth/munge" in conf
    assert "NodeName=node01,node02,node03 CPUs=2" in conf
    assert "ProctrackType=proctrack/linuxproc" in conf and "TaskPlugin=task/none" in conf


def test_the_blamed_rank_is_the_one_the_others_found_dead():
    log = "\n".join([
        "[rank0] ERROR distlib.transport.tcp: pg0/gloo: aborting: pg0/gloo: rank 3 (10.0.0.3:4) closed the "
        "connection while rank 2 was receiving a frame header: rank 3 died, was killed, or destroyed its process group",
        "srun: error: node02: task 3: Killed",
        "srun: error: node02: task 2: Exited with exit code 3",
        "srun: error: node01: tasks 0-1: Exited with exit code 3",
    ])
    assert slurm.blame(log) == "rank 3 (task 3 of the step on node02; srun: Killed), which the other ranks found dead"


def test_without_distlibs_words_the_task_killed_by_a_signal_is_blamed():
    log = "srun: error: node01: tasks 0-1,3: Exited with exit code 1\nsrun: error: node02: task 2: Segmentation fault"
    assert slurm.blame(log) == "task 2 on node02: Segmentation fault (srun)"
    assert slurm.blame("srun: error: node01: tasks 0-1,3: Exited with exit code 1") == \
        "tasks 0-1,3 on node01: Exited with exit code 1 (srun)"
    assert slurm.blame("nothing here") is None


def test_a_munge_key_per_run(tmp_path):
    first = slurm.make_key(tmp_path / "a" / "munge")
    second = slurm.make_key(tmp_path / "b" / "munge")
    assert len(first.read_bytes()) == 1024 and first.read_bytes() != second.read_bytes()
    assert stat.S_IMODE(first.stat().st_mode) == 0o600 and stat.S_IMODE(first.parent.stat().st_mode) == 0o700
    slurm.remove_keys(tmp_path)
    assert not first.exists() and not second.exists()


# -- real runs --------------------------------------------------------------------------------------


@pytest.mark.slurm
def test_cluster_up_slurm_runs_the_job_through_sbatch_and_reports(slurm_image, docker_client, cluster_state):
    """2 slurmd nodes x 2 tasks: `up` exits 0 and prints the report; the ranks met through env://
    at the first node with the port of the job id; every container held the run's token and
    munge key read-only; `down` removes containers, network, volumes, key and token."""
    need_compose()
    proc = run_cluster("up", cluster_state, image=slurm_image, MODE="slurm", NODES="2", NPROC_PER_NODE="2",
                       JOB_ARGS="--epochs 2 --bench-sizes 4KiB")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out, err = proc.stdout, proc.stderr
    assert "distlib train_dp report" in out and "RESULT: PASS" in out, out
    assert "made this cluster's munge key in " in err, err
    project = project_of(cluster_state)
    (ctld,) = engine.project_containers(docker_client, project, "slurmctld")
    said = engine.logs_text(ctld)
    assert "Slurm cluster up: slurmctld and 2 idle node(s) (node01, node02)" in said, said
    assert "sbatch --wait" in said and "job 1 submitted" in said and "#SBATCH --ntasks-per-node=2" in said, said
    report = json.loads((cluster_state / project / "report.json").read_text())
    run = report["run"]
    assert run["world_size"] == 4 and run["init_method"] == "env://", run
    assert run["init"].startswith("env:// with rank 0 hosting the store at node01:"), run
    assert run["run_id"] == "slurm-1.0", run
    ranks = report["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3]
    assert [r["dns_name"] for r in ranks] == ["node01", "node01", "node02", "node02"], ranks
    assert [r["local_rank"] for r in ranks] == [0, 1, 0, 1] and [r["node_rank"] for r in ranks] == [0, 0, 1, 1]
    assert report["weights"]["identical"], report["weights"]
    check_the_run_used_its_token(proc, docker_client, cluster_state, project, "slurm")
    key = cluster_state / project / "munge" / "munge.key"
    assert len(key.read_bytes()) == 1024
    containers = engine.project_containers(docker_client, project)
    assert containers, f"no container of {project} left to look at (nor for `down` to remove)"
    for container in containers:
        mounts = [m for m in container.attrs["Mounts"] if m["Destination"] == MUNGE_TARGET]
        assert [(m["Source"], m["RW"]) for m in mounts] == [(str(key), False)], container.name
    down = run_cluster("down", cluster_state)
    assert down.returncode == 0, down.stderr
    assert leftovers(docker_client, project) == []
    assert not key.exists() and not (cluster_state / project / "auth").exists()


FAILING_JOB = """\
import os, sys, numpy as np, distlib
distlib.init_process_group("gloo")
if distlib.get_rank() == 1:
    os._exit(7)
x = np.ones(4)
for _ in range(1000):
    distlib.all_reduce(x)
"""


@pytest.mark.slurm
def test_cluster_up_slurm_names_the_rank_that_died(slurm_image, docker_client, cluster_state, tmp_path):
    """A user's JOB (its directory mounted on the nodes as the tasks' working directory) whose
    rank 1 exits: `up` fails with the job's status and names rank 1, where srun ran it."""
    need_compose()
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    (job_dir / "dies.py").write_text(FAILING_JOB)
    os.chmod(job_dir, 0o755)
    os.chmod(job_dir / "dies.py", 0o644)
    proc = run_cluster("up", cluster_state, image=slurm_image, MODE="slurm", NODES="2", NPROC_PER_NODE="2",
                       JOB="python dies.py", cwd=job_dir)
    assert proc.returncode == 7, proc.stdout + proc.stderr  # srun's (and sbatch --wait's): the task's status
    assert "cluster: FAILED: rank 1 (task 1 of the step on node01; srun: Exited with exit code 7), which the " \
           "other ranks found dead" in proc.stderr, proc.stderr
    assert "slurm_node: job 1 ended: JobState=FAILED ExitCode=7:0" in proc.stderr, proc.stderr
