"""Elastic jobs in real containers: ``distlib-run --nnodes MIN:MAX`` on every host of a
distlib.testing cluster (the deployment's default job, deploy/distlib_deploy/jobs/train_dp.py,
checkpointing to the shared volume), while the schedule kills, restarts and adds hosts, or
kills the master service.

* 3 nodes, --nnodes 2:3: one killed during training -> the other two form round 1, resume from
  the checkpoint and complete; the round names the lost node (the rounds on the master service,
  and on a FileStore in the shared volume).
* a fourth node started mid-run (--nnodes 2:4) is admitted at the next round.
* a worker that crashes every time exhausts --max-restarts 2: the job fails within bounded time,
  after three rounds, each caused by it.
* a node killed and restarted at once gets no free restart (torch #147064).
* the master service killed: every node fails naming it, nobody hangs.

Marker ``containers``; the image is the session's (DISTLIB_TEST_IMAGE), nothing is built here.
"""

from __future__ import annotations

import re

import pytest

from distlib.testing import Job, Result, cues, faults

pytestmark = [pytest.mark.containers, pytest.mark.timeout(600)]

#: a 4 s heartbeat bound and last call: short, so that the tests are quick on a loaded machine
RDZV_CONF = "keep_alive_interval=1,keep_alive_max_attempt=4,last_call_timeout=4,join_timeout=120"
EPOCH_1 = r"train_dp: epoch 1/"


def elastic(cluster, *job_args: str, nnodes: str, max_restarts: int, rdzv_endpoint=None) -> Job:
    checkpoint = f"{cluster.substrate.shared}/ckpt/train_dp.npz"
    return Job.launch(["-m", "distlib_deploy.jobs.train_dp", "--bench-sizes", "none", "--step-seconds", "0.1",
                       "--checkpoint", checkpoint, "--checkpoint-every", "10", *job_args],
                      nnodes=nnodes, max_restarts=max_restarts, rdzv_conf=RDZV_CONF, rdzv_endpoint=rdzv_endpoint)


def said(result: Result, pattern: str, hosts=None) -> list:
    """The lines matching ``pattern`` on ``hosts`` (default: every node)."""
    names = hosts or [n for n in result.hosts if n != "master"]
    return [line for n in names for line in result.hosts[n].output if re.search(pattern, line)]


@pytest.mark.parametrize("rounds_on", ["master", "file"])
def test_a_killed_node_leaves_a_smaller_job_that_resumes_and_completes(containers, rounds_on):
    """master: the rounds on the master service; file: on a FileStore in the shared volume (no
    master service in the job at all, as on an NFS cluster)."""
    cluster = containers(3)
    endpoint = f"file://{cluster.substrate.shared}/rdzv" if rounds_on == "file" else None
    result = cluster.run(elastic(cluster, "--epochs", "4", nnodes="2:3", max_restarts=3, rdzv_endpoint=endpoint),
                         [(cues.Output(EPOCH_1), faults.KillNode(2))], deadline=400)
    result.assert_finished(world_size=2, restarts=1)
    assert said(result, r"RESULT: PASS") and said(result, r"run \S+: 2 ranks on"), result.report()
    assert said(result, r"elastic: this is restart 1 of at most 3; resumed from the checkpoint at step \d+"), \
        result.report()
    lost = said(result, r"^distlib-run: round 1 \(restart 1 of at most 3\): node lost: ", ["node0", "node1"])
    assert lost and all("node2" in line for line in lost), lost


def test_a_fourth_node_is_admitted_at_the_next_round(containers):
    cluster = containers(4)
    result = cluster.run(elastic(cluster, "--epochs", "4", nnodes="2:4", max_restarts=3),
                         [(cues.Output(EPOCH_1), faults.StartNode(3))], held=[3], deadline=400)
    result.assert_finished(world_size=4, restarts=1)
    joined = said(result, r"^distlib-run: round 1 \(restart 1 of at most 3\): node joined: ")
    assert len(joined) == 4 and all("node3" in line for line in joined), joined
    assert said(result, r"run \S+: 4 ranks on"), result.report()


def test_a_worker_that_crashes_every_time_exhausts_max_restarts(containers):
    cluster = containers(3)
    result = cluster.run(elastic(cluster, "--crash-rank", "1", nnodes="3", max_restarts=2), deadline=240)
    result.assert_no_hang()
    assert all(h.exit_code not in (0, None) for n, h in result.hosts.items() if n != "master"), result.report()
    # three rounds: the start, and two restarts each caused by the worker of rank 1 (whichever
    # node's agent reported first)
    for r in (1, 2):
        causes = said(result, rf"^distlib-run: round {r} \(restart {r} of at most 2\): ")
        assert causes and all("worker failed: global rank 1 " in c for c in causes), causes
    assert said(result, r"no restarts are left \(--max-restarts 2: 2 used\)"), result.report()
    assert not said(result, r"RESULT: PASS")


def test_a_node_killed_and_restarted_at_once_gets_no_free_restart(containers):
    """torch #147064. Kill node1 and start it again at once, twice: the first time costs the
    job's one restart, the second fails it."""
    cluster = containers(2)
    result = cluster.run(elastic(cluster, "--epochs", "50", nnodes="2", max_restarts=1), [
        (cues.Output(EPOCH_1), faults.KillNode(1)), (cues.After(0), faults.StartNode(1)),
        (cues.Output(r"train_dp: first collective done: restart 1"), faults.KillNode(1)),
        (cues.After(0), faults.StartNode(1)),
    ], deadline=300)
    result.assert_no_hang()
    assert said(result, r"^distlib-run: round 1 \(restart 1 of at most 1\)"), result.report()
    assert said(result, r"no restarts are left \(--max-restarts 1: 1 used\)"), result.report()
    assert result.hosts["node0"].exit_code != 0, result.report()


def test_the_master_service_killed_fails_every_node_naming_it(containers):
    cluster = containers(3)
    result = cluster.run(elastic(cluster, "--epochs", "50", nnodes="2:3", max_restarts=3),
                         [(cues.Output(EPOCH_1), faults.KillMaster())], deadline=240)
    result.assert_no_hang()
    for n in ("node0", "node1", "node2"):
        host = result.hosts[n]
        assert host.exit_code == 1, (n, host.tail(20))
        assert said(result, r"the elastic job cannot go on: the rendezvous store \(TCPStore server master:29500\) did "
                            r"not answer for", [n]), (n, host.tail(20))
