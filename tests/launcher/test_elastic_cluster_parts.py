"""The Compose cluster's elastic parts without Docker: the settings (MIN_NODES, MAX_RESTARTS),
the command each worker runs (compose_node), and the rounds read back from the agents' logs."""

from __future__ import annotations

from pathlib import Path

import pytest

from distlib_deploy.cluster import elastic
from distlib_deploy.cluster.config import Settings
from distlib.command import ToolError
from distlib_deploy.jobs import compose_node

ROOT = Path(__file__).resolve().parents[2]


def settings(**env):
    return Settings.from_env(ROOT, {"NODES": "3", **env})


def test_no_elastic_variables_no_elastic_file():
    cfg = settings()
    assert cfg.elastic is None and not any(f.endswith("elastic.yml") for f in cfg.compose_files())


def test_min_nodes_and_max_restarts_make_an_elastic_run():
    cfg = settings(MIN_NODES="2", MAX_RESTARTS="3", STEP_SECONDS="0.2")
    assert any(f.endswith("compose/elastic.yml") for f in cfg.compose_files())
    variables = cfg.compose_variables("r1")
    assert (variables["MIN_NODES"], variables["MAX_RESTARTS"], variables["STEP_SECONDS"]) == ("2", "3", "0.2")


@pytest.mark.parametrize("env, words", [
    ({"MIN_NODES": "4"}, "MIN_NODES=4: the fewest nodes the job runs with, from 1 to NODES=3"),
    ({"MAX_RESTARTS": "-1"}, "MAX_RESTARTS=-1"),
    ({"MIN_NODES": "2", "MODE": "rank0"}, "an elastic job needs MODE=tcp"),
])
def test_bad_elastic_settings_exit_2_naming_the_variable(env, words):
    with pytest.raises(ToolError, match=words) as err:
        settings(**env)
    assert err.value.status == 2


@pytest.fixture
def node_env(monkeypatch):
    for name in ("JOB", "JOB_ARGS", "CLUSTER_GPUS_PER_NODE", "RDZV_CONF", "STEP_SECONDS", "CHECKPOINT_EVERY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("DISTLIB_RUN_ID", "r7")
    monkeypatch.setenv("NODES", "3")
    monkeypatch.setenv("MIN_NODES", "2")
    monkeypatch.setenv("MAX_RESTARTS", "3")
    return monkeypatch


def test_an_elastic_tcp_worker_runs_distlib_run_with_the_range_and_no_node_rank(node_env):
    node_env.setenv("DISTLIB_CLUSTER_MODE", "tcp")
    node_env.setenv("STEP_SECONDS", "0.1")
    cmd = compose_node.build_command(["--report-json", "/workspace/report.json"])
    assert cmd[:5] == ["distlib-run", "--nproc-per-node", "1", "--run-id", "r7"]
    assert cmd[5:13] == ["--nnodes", "2:3", "--max-restarts", "3", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                         "master:29500"]
    assert "--node-rank" not in cmd
    assert cmd[13:] == ["-m", "distlib_deploy.jobs.train_dp", "--report-json", "/workspace/report.json",
                        "--checkpoint", "/workspace/checkpoints/r7/train_dp.npz", "--checkpoint-every", "10",
                        "--step-seconds", "0.1"]


def test_an_elastic_file_worker_keeps_the_rounds_in_a_shared_file(node_env):
    node_env.setenv("DISTLIB_CLUSTER_MODE", "file")
    node_env.setenv("RDZV_CONF", "join_timeout=60")
    cmd = compose_node.build_command([])
    assert cmd[cmd.index("--rdzv-endpoint") + 1] == "file:///shared/r7/rdzv"
    assert cmd[cmd.index("--rdzv-conf") + 1] == "join_timeout=60"


def test_an_elastic_rank0_worker_is_refused(node_env):
    node_env.setenv("DISTLIB_CLUSTER_MODE", "rank0")
    with pytest.raises(ToolError, match="need MODE=tcp, file or nfs"):
        compose_node.build_command([])


LOG_A = """\
distlib-run: round 0 (restart 0 of at most 3): start; now 3 node(s), world size 3 (this node: node rank 0, global ranks 0..0)
[rank0]: train_dp: epoch 1/5
distlib-run: round 1 (restart 1 of at most 3): node lost: 5f3a2b1c9d8e (172.18.0.4, pid 7): no heartbeat for 10 s; worker failed: global rank 0 (local rank 0) on 0a1b2c3d4e5f (172.18.0.3, pid 7) exited with code 1; now 2 node(s), world size 2 (this node: node rank 0, global ranks 0..0)
"""
LOG_LOST = LOG_A.splitlines()[0] + "\n"


def test_the_rounds_come_from_the_longest_record():
    rounds = elastic.rounds_from_logs({"a": LOG_A, "b": LOG_LOST})
    assert [r[0] for r in rounds] == [0, 1]
    assert rounds[1][1].startswith("node lost: 5f3a2b1c9d8e (172.18.0.4, pid 7): no heartbeat for 10 s")
    assert rounds[1][2:] == (2, 2)
    assert elastic.GONE.findall(rounds[1][1]) == ["5f3a2b1c9d8e"]
