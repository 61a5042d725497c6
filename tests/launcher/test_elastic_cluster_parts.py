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


def test_the_stores_absences_come_from_the_agents_final_lines():
    line = ("distlib-run: the rendezvous store (TCPStore server master:29500) was away for 2.6 s in round 0 (from "
            "2026-11-28 14:02:11 UTC): the job went on in the same round, no restart counted\n")
    logs = {"a": "[rank0]: training\n" + line, "b": line + line.replace("2.6 s", "9.0 s").replace("14:02", "14:09"),
            "c": ""}
    assert elastic.absences_from_logs(logs) == [
        ("TCPStore server master:29500", "was away for 2.6 s in round 0 (from 2026-11-28 14:02:11 UTC): the job went "
                                         "on in the same round, no restart counted"),
        ("TCPStore server master:29500", "was away for 9.0 s in round 0 (from 2026-11-28 14:09:11 UTC): the job went "
                                         "on in the same round, no restart counted")]


class FakeMaster:
    """A master container as the watch reads it: its State, changed by the test."""

    def __init__(self):
        self.attrs = {"State": {"Running": True, "Health": {"Status": "healthy"}}}

    def reload(self):
        pass

    def set(self, running, health, finished="", code=0):
        self.attrs = {"State": {"Running": running, "Health": {"Status": health}, "FinishedAt": finished,
                                "ExitCode": code}}


def test_the_watch_sees_the_master_away_from_its_exit_to_its_healthcheck():
    """Killed at 12:00:01.5 (the engine's FinishedAt), seen down at :02, restarting, its
    healthcheck passing again at :05: one absence of 3.5 s, exit status 137."""
    from distlib_deploy.cluster.master import MasterWatch
    from distlib_deploy.cluster.outcome import parse_docker_time

    fake = FakeMaster()
    watch = MasterWatch(fake)
    t0 = parse_docker_time("2026-11-28T12:00:00Z").at.timestamp()
    watch.look(t0)
    fake.set(False, "unhealthy", "2026-11-28T12:00:01.5Z", 137)
    watch.look(t0 + 2)
    fake.set(True, "starting")
    watch.look(t0 + 3)
    fake.set(True, "healthy")
    watch.look(t0 + 5)
    watch.look(t0 + 6)
    (away,) = watch.absences
    assert (away.left, away.seconds, away.status) == (t0 + 1.5, 3.5, 137), away
    assert away.words() == ("away for 3.5 s: it exited with 137 at 12:00:01 UTC and answered its healthcheck 3.5 s "
                            "later (restarted by Compose)")
    fake.set(True, "starting", "2026-11-28T12:00:07.25Z", 0)  # restarted before the watch looked
    watch.look(t0 + 8)
    fake.set(True, "healthy", "2026-11-28T12:00:07.25Z", 0)
    watch.look(t0 + 9)
    assert (watch.absences[-1].left, watch.absences[-1].seconds, watch.absences[-1].status) == (t0 + 7.25, 1.75, None)
    assert "it exited or stopped answering at 12:00:07 UTC" in watch.absences[-1].words()
    fake.set(False, "unhealthy", "2026-11-28T12:00:09.5Z", 1)
    watch.look(t0 + 10)
    assert watch.stop()[-1].seconds is None  # never back while watched
    assert "did not answer its healthcheck again" in watch.absences[-1].words()
