"""The Compose cluster's master service killed mid-job and restarted by Compose (issue 36).

`make cluster-up` in elastic mode (NODES=3 MIN_NODES=2, mode tcp) with the master's state on
its volume (compose/mode-tcp.yml: --state-dir, restart: on-failure). Once every worker trains,
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

import pytest

from distlib_deploy.cluster import engine, state
from tests.support.compose import need_compose, run_cluster, start_cluster

pytestmark = [pytest.mark.containers, pytest.mark.timeout(600)]

#: the engine's words for the absence (distlib_deploy/cluster/master.py, Away.words)
ENGINE_AWAY = re.compile(r"the master service was away for ([\d.]+) s: it exited with 137 at [\d:]+ UTC and "
                         r"answered its healthcheck [\d.]+ s later \(restarted by Compose\)")
#: the job's words (every agent's report line, as `up` lists it)
JOB_AWAY = re.compile(r"was away for ([\d.]+) s in round 0 \(from [^)]*\): the job went on in the same round, "
                      r"no restart counted")


def _worker_logs(docker_client, project: str) -> dict:
    return {c.name: engine.logs_text(c) for c in engine.project_containers(docker_client, project, "worker")}


def test_a_master_killed_mid_job_is_restarted_by_compose_with_its_state_and_the_job_completes(
        distlib_image, docker_client, cluster_state):
    need_compose()
    up = start_cluster("up", cluster_state, image=distlib_image, MODE="tcp", NODES="3", MIN_NODES="2",
                       MAX_RESTARTS="3", STEP_SECONDS="0.1", JOB_ARGS="--epochs 3 --bench-sizes none")
    try:
        deadline = time.monotonic() + 180
        training = None
        while training is None and time.monotonic() < deadline and up.poll() is None:
            run = state.load(cluster_state)  # None until up has recorded the run
            logs = _worker_logs(docker_client, run.project) if run is not None else {}
            if len(logs) == 3 and all("train_dp: epoch 1/" in text for text in logs.values()):
                training = run
            else:
                time.sleep(0.5)
        assert training is not None, f"the 3 workers did not reach epoch 1 within 180 s (up: {up.poll()})"
        killed = run_cluster("kill", cluster_state, NODE="master")
        assert killed.returncode == 0, killed.stdout + killed.stderr
        assert "with SIGKILL" in killed.stdout, killed.stdout
        out, err = up.communicate(timeout=360)
    finally:
        if up.poll() is None:
            up.kill()
            up.communicate()
    assert up.returncode == 0, out[-4000:] + err[-2000:]
    assert "job succeeded" in out and "RESULT: PASS" in out, out[-4000:]
    report = json.loads((cluster_state / training.project / "report.json").read_text())
    assert report["elastic"]["restart_count"] == 0, report["elastic"]
    engine_away = [float(s) for s in ENGINE_AWAY.findall(out)]
    job_away = [float(s) for s in JOB_AWAY.findall(out)]
    assert len(engine_away) == 1, f"up does not say how long the master was away:\n{out[-4000:]}"
    assert job_away and all(0 < s < 60 for s in job_away), f"the rounds do not list the absence:\n{out[-4000:]}"
    assert not re.search(r"round 1 \(restart 1", out), f"the job restarted:\n{out[-4000:]}"
    print(f"\n[compose master killed] engine: away {engine_away[0]:.1f} s; the job's report: away {job_away} s")
