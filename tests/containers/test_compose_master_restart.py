"""The Compose cluster's master service killed mid-job and restarted by Compose (issue 36).

`make cluster-up` in elastic mode (NODES=3 MIN_NODES=2, mode tcp) with the master's state on
its volume (compose/mode-tcp.yml: --state-dir, restart: on-failure). Once the job has finished its first epoch,
`make cluster-kill NODE=master` SIGKILLs the store server inside its container, as an OOM kill
would; Docker starts it again, it replays its journal before its port opens, and the agents,
which kept their workers running, go on in the same round. `up` exits 0, rank 0's report says
restart count 0, and `up`'s output says the master was away and for how long: from the engine's
side (exit to healthy again) and from the job's (every node's absence line).

Marker ``containers``; the image is the session's (DISTLIB_TEST_IMAGE), nothing is built here.
"""

from __future__ import annotations

import json
import re
import time

import docker
import pytest

from distlib_deploy.cluster import engine, state
from tests.support.compose import need_compose, run_cluster, start_cluster

pytestmark = [pytest.mark.containers, pytest.mark.timeout(600)]

#: the engine's words for the absence (distlib_deploy/cluster/master.py, Away.words)
#: (its exit status when the watch saw it stopped; Docker often restarts it before the next look)
ENGINE_AWAY = re.compile(r"the master service was away for ([\d.]+) s: it (?:exited with 137|exited or stopped "
                         r"answering) at [\d:]+ UTC and answered its healthcheck [\d.]+ s later \(restarted by Compose\)")
#: the job's words (every agent's report line, as `up` lists it)
JOB_AWAY = re.compile(r"was away for ([\d.]+) s in round 0 \(from [^)]*\): the job went on in the same round, "
                      r"no restart counted")


def _worker_logs(docker_client, project: str) -> dict:
    logs = {}
    for c in engine.project_containers(docker_client, project, "worker"):
        try:
            logs[c.name] = engine.logs_text(c)
        except docker.errors.NotFound:  # a container of a run `up` is replacing
            continue
    return logs


def test_a_master_killed_mid_job_is_restarted_by_compose_with_its_state_and_the_job_completes(
        distlib_image, docker_client, cluster_state):
    need_compose()
    up = start_cluster("up", cluster_state, image=distlib_image, MODE="tcp", NODES="3", MIN_NODES="2",
                       MAX_RESTARTS="3", STEP_SECONDS="0.1", JOB_ARGS="--epochs 8 --bench-sizes none")
    try:
        deadline = time.monotonic() + 180
        training = None
        while training is None and time.monotonic() < deadline and up.poll() is None:
            run = state.load(cluster_state)  # None until up has recorded the run
            logs = _worker_logs(docker_client, run.project) if run is not None else {}
            # rank 0 says each epoch's end (4 s each: 40 steps x STEP_SECONDS); the kill comes
            # after the first, 28 s before the job's end
            if len(logs) == 3 and any("train_dp: epoch 1/8" in text for text in logs.values()):
                training = run
            else:
                time.sleep(0.5)
        assert training is not None, f"the job did not finish epoch 1 within 180 s (up exited: {up.poll()})"
        killed = run_cluster("kill", cluster_state, NODE="master")
        assert killed.returncode == 0, killed.stdout + killed.stderr
        assert "with SIGKILL" in killed.stdout + killed.stderr, killed.stdout + killed.stderr
        out, err = up.communicate(timeout=360)
    finally:
        if up.poll() is None:
            up.kill()
            up.communicate()
    said = err  # up's own lines (the report is on stdout)
    assert up.returncode == 0, out[-4000:] + said[-4000:]
    assert "RESULT: PASS" in out and "job succeeded" in said, out[-4000:] + said[-4000:]
    report = json.loads((cluster_state / training.project / "report.json").read_text())
    assert report["elastic"]["restart_count"] == 0, report["elastic"]
    engine_away = [float(s) for s in ENGINE_AWAY.findall(said)]
    job_away = [float(s) for s in JOB_AWAY.findall(said)]
    assert len(engine_away) == 1, f"up does not say how long the master was away:\n{said[-4000:]}"
    assert job_away and all(0 < s < 60 for s in job_away), f"the rounds do not list the absence:\n{said[-4000:]}"
    assert not re.search(r"round 1 \(restart 1", said), f"the job restarted:\n{said[-4000:]}"
    print("\n" + "\n".join(line for line in said.splitlines() if "away" in line or "succeeded" in line))
    print(f"[compose master killed] engine: away {engine_away[0]:.1f} s; the job's report: away {job_away} s")
