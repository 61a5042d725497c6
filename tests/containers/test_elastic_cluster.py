"""Elastic jobs in real containers: the Compose cluster with MIN_NODES/MAX_RESTARTS
(`distlib cluster up`, what `make cluster-up` runs) while a test kills, restarts and adds
worker containers, or kills the master service.

* 3 nodes, --nnodes 2:3: one killed during training -> the other two form round 1 within 30 s,
  resume from the checkpoint and complete; the run's rounds name the lost container (the rounds
  on the master service, and on a FileStore in a shared volume).
* a fourth node started mid-run (MAX_NODES=4) is admitted at the next round.
* a worker that crashes every time exhausts --max-restarts 2: the job fails within bounded time,
  listing three rounds and their causes.
* a node killed and restarted at once gets no free restart (torch #147064).
* the master service killed: every node fails naming it, nobody hangs.

Marker ``containers``; the image is the session's (DISTLIB_TEST_IMAGE), nothing is built here.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, List, Optional

import pytest

from distlib_deploy.cluster import engine, state
from tests.support.compose import CLUSTER_VARIABLES, need_compose, run_cluster
from tests.fixtures.docker import REPO_ROOT

pytestmark = [pytest.mark.containers, pytest.mark.timeout(600)]

#: a 4 s heartbeat bound and last call: short, so that the tests are quick on a loaded machine
RDZV_CONF = "keep_alive_interval=1,keep_alive_max_attempt=4,last_call_timeout=4,join_timeout=120"


class Cluster:
    """`distlib cluster up` running in the background, and a look into its containers."""

    def __init__(self, state_dir: Path, image: str, docker_client, **env: str):
        full = {k: v for k, v in os.environ.items() if k not in CLUSTER_VARIABLES + ("MIN_NODES", "MAX_NODES",
                                                                                   "MAX_RESTARTS", "RDZV_CONF")}
        full.update(CLUSTER_STATE_DIR=str(state_dir), SKIP_BUILD="1", QUIET="1", CLUSTER_TIMEOUT="400",
                    IMAGE=image, RDZV_CONF=RDZV_CONF, **env)
        self.env = full
        self.state_dir = state_dir
        self.client = docker_client
        self.proc = subprocess.Popen([sys.executable, "-m", "distlib_deploy.cluster", "up"], cwd=REPO_ROOT, env=full,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     stdin=subprocess.DEVNULL)
        self.stdout = self.stderr = ""

    def run(self) -> state.Run:
        return state.load(self.state_dir)

    def workers(self) -> List:
        """The run's worker containers (listed again when one vanishes while being listed)."""
        import docker

        run = self.run() if (self.state_dir / "current.json").exists() else None
        for _ in range(5):
            try:
                return engine.project_containers(self.client, run.project, "worker") if run else []
            except docker.errors.NotFound:
                time.sleep(0.2)
        return engine.project_containers(self.client, run.project, "worker")

    def worker(self, number: int):
        return next(w for w in self.workers() if engine.short_name(w) == f"worker-{number}")

    def wait_for_log(self, pattern: str, timeout: float, what: str, count: int = 1) -> float:
        """Wait until ``count`` workers' logs match ``pattern``; the time it happened."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.finish(0)
                raise AssertionError(f"`up` ended while waiting for {what}:\n{self.stderr[-4000:]}")
            if sum(bool(re.search(pattern, self._logs(w), re.M)) for w in self.workers()) >= count:
                return time.monotonic()
            time.sleep(0.3)
        raise AssertionError(f"no {what} within {timeout} s:\n" +
                             "\n".join(engine.logs_text(w)[-1500:] for w in self.workers()))

    @staticmethod
    def _logs(container) -> str:
        """A container's log; "" for one that went away between listing and reading."""
        import docker

        try:
            return engine.logs_text(container)
        except docker.errors.NotFound:
            return ""

    def kill(self, number: int) -> str:
        done = run_cluster("kill", self.state_dir, NODE=str(number))
        assert done.returncode == 0, done.stderr
        return done.stderr

    def finish(self, timeout: float = 300) -> int:
        try:
            self.stdout, self.stderr = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.stdout, self.stderr = self.proc.communicate()
            raise AssertionError(f"`up` did not end within {timeout} s:\n{self.stderr[-4000:]}") from None
        return self.proc.returncode

    def scale(self, workers: int) -> None:
        """Start more worker containers of the running project (Compose's --scale --no-recreate)."""
        run = self.run()
        compose = engine.Compose(tuple(run.compose), "")
        done = engine.run_compose(compose, run.project, run.files, ["up", "-d", "--no-build", "--no-recreate",
                                                                     "--scale", f"worker={workers}"],
                                  {**self.env, **run.variables}, log_path=str(self.state_dir / "scale.log"),
                                  timeout=120)
        assert done.returncode == 0, (self.state_dir / "scale.log").read_text()[-3000:]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate()


@pytest.fixture
def cluster(tmp_path, docker_client, distlib_image):
    need_compose()
    made: List[Cluster] = []
    state_dir = tmp_path / "cluster-state"

    def start(**env: str) -> Cluster:
        made.append(Cluster(state_dir, distlib_image, docker_client, **env))
        return made[-1]

    yield start
    for c in made:
        c.close()
    if state_dir.exists():
        run_cluster("down", state_dir, timeout=120)


def hostname(container) -> str:
    return container.attrs["Config"]["Hostname"]


def first_collective(text: str, restart: int) -> Optional[float]:
    m = re.search(rf"train_dp: first collective done: restart {restart}, world size \d+, unix ([\d.]+)", text)
    return float(m.group(1)) if m else None


@pytest.mark.parametrize("mode", ["tcp", "file"])
def test_a_killed_node_leaves_a_smaller_job_that_resumes_and_completes(cluster, mode):
    """tcp: the rounds on the master service; file: on a FileStore in the shared volume (no
    master service at all, as on an NFS cluster)."""
    c = cluster(MODE=mode, NODES="3", MIN_NODES="2", MAX_RESTARTS="3", STEP_SECONDS="0.1",
                JOB_ARGS="--epochs 4 --bench-sizes none")
    c.wait_for_log(r"train_dp: epoch 1/4", 240, "epoch 1 on rank 0")
    victim = c.worker(2)
    victim_host = hostname(victim)
    said = c.kill(2)
    killed_at = time.time()
    assert f"killed worker-2 ({victim.name}, host {victim_host}" in said
    assert c.finish() == 0, c.stderr[-5000:]
    out, err = c.stdout, c.stderr
    assert "RESULT: PASS" in out and "2 ranks" in out, out
    assert re.search(r"elastic: this is restart 1 of at most 3; resumed from the checkpoint at step \d+", out), out
    # round 1 within 30 s of the kill: its first collective, on rank 0 of the survivors
    firsts = [first_collective(engine.logs_text(w), 1) for w in c.workers() if w.id != victim.id]
    assert any(firsts) and min(f for f in firsts if f) - killed_at < 30, firsts
    assert "cluster: elastic: the job's rounds (2):" in err, err
    assert re.search(rf"cluster:   round 1: node lost: worker-2 \({victim_host}, \S+, pid \d+\): no heartbeat for "
                     r"\d+ s.* -> 2 node\(s\), world size 2", err), err
    assert "worker-2" in err and "left the job (exit status 137)" in err, err
    assert "job succeeded" in err


def test_a_fourth_node_is_admitted_at_the_next_round(cluster):
    c = cluster(NODES="3", MAX_NODES="4", MIN_NODES="2", MAX_RESTARTS="3", STEP_SECONDS="0.1",
                JOB_ARGS="--epochs 4 --bench-sizes none")
    c.wait_for_log(r"train_dp: epoch 1/4", 240, "epoch 1 on rank 0")
    c.scale(4)
    c.wait_for_log(r"^distlib-run: round 1 \(restart 1 of at most 3\): node joined: ", 120, "round 1 on every node", 4)
    assert c.finish() == 0, c.stderr[-5000:]
    assert "RESULT: PASS" in c.stdout and "4 ranks" in c.stdout, c.stdout
    newcomer = c.worker(4)
    assert re.search(rf"cluster:   round 1: node joined: worker-4 \({hostname(newcomer)}, .* -> 4 node\(s\), world "
                     r"size 4", c.stderr), c.stderr


def test_a_worker_that_crashes_every_time_exhausts_max_restarts(cluster):
    c = cluster(NODES="3", MAX_RESTARTS="2", JOB_ARGS="--crash-rank 1 --bench-sizes none")
    started = time.monotonic()
    status = c.finish(240)
    assert status != 0, c.stderr[-4000:]
    assert time.monotonic() - started < 240
    err = c.stderr
    assert "cluster: elastic: the job's rounds (3):" in err, err
    rounds = re.findall(r"^cluster:   round (\d): (.*) -> 3 node\(s\)", err, re.M)
    assert [r for r, _ in rounds] == ["0", "1", "2"], err
    # the cause is the worker that exited first (rank 1 crashes; its peers fail a moment later),
    # whichever node's agent reported first
    assert rounds[0][1] == "start", rounds
    assert all(cause.startswith("worker failed: global rank 1 ") for _, cause in rounds[1:]), rounds
    assert "no restarts are left (--max-restarts 2: 2 used)" in err, err
    assert "RESULT: PASS" not in c.stdout


def test_a_node_killed_and_restarted_at_once_gets_no_free_restart(cluster):
    """torch #147064. Kill worker-2 and start its container again at once, twice: the first
    time costs the job's one restart, the second fails it."""
    c = cluster(NODES="2", MAX_RESTARTS="1", STEP_SECONDS="0.1", JOB_ARGS="--epochs 50 --bench-sizes none")
    c.wait_for_log(r"train_dp: epoch 1/50", 240, "epoch 1 on rank 0")
    victim = c.worker(2)
    victim.kill()
    victim.start()
    c.wait_for_log(r"^distlib-run: round 1 \(restart 1 of at most 1\)", 120, "round 1 on both nodes", 2)
    c.wait_for_log(r"train_dp: first collective done: restart 1", 120, "round 1's first collective")
    victim.kill()
    victim.start()
    assert c.finish(240) != 0, c.stderr[-4000:]
    assert "no restarts are left (--max-restarts 1: 1 used)" in c.stderr, c.stderr[-4000:]


def test_the_master_service_killed_fails_every_node_naming_it(cluster, docker_client):
    c = cluster(NODES="3", MIN_NODES="2", MAX_RESTARTS="3", STEP_SECONDS="0.1",
                JOB_ARGS="--epochs 50 --bench-sizes none")
    c.wait_for_log(r"train_dp: epoch 1/50", 240, "epoch 1 on rank 0")
    (master,) = engine.project_containers(docker_client, c.run().project, "master")
    master.kill()
    killed_at = time.monotonic()
    assert c.finish(240) != 0
    assert time.monotonic() - killed_at < 120, "a node hung after the master service was killed"
    for w in c.workers():
        w.reload()
        text = engine.logs_text(w)
        assert w.attrs["State"]["ExitCode"] == 1, (engine.short_name(w), text[-2000:])
        assert re.search(r"the elastic job cannot go on: the rendezvous store \(TCPStore server master:29500\) did "
                         r"not answer for", text), text[-2000:]
