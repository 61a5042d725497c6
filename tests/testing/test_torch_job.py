"""A torch.distributed job (torch 2.13, ``make test-interop``) on the harness's hosts: it
rendezvouses through the distlib master service the harness runs, and is broken on cue like a
distlib job. Marker ``interop``."""

import re

import pytest

from distlib.testing import Job, cues, faults

torch = pytest.importorskip("torch", reason="torch not importable: run `make test-interop`")

pytestmark = [pytest.mark.interop, pytest.mark.usefixtures("needs_namespaces")]

JOB = "tests/testing/jobs/torch_steps.py"


def test_a_torch_job_runs_on_three_hosts_through_the_master_service(distlib_cluster):
    result = distlib_cluster(nodes=3).run(Job.script(JOB, env={"STEPS": "10"}), deadline=180)
    result.assert_ok(world_size=3)
    for r in range(3):
        assert f"torch_steps: rank {r}/3 ok host=node{r} sum=30" in result.ranks[r].output, result.ranks[r].output[-3:]


def test_a_torch_job_whose_node_is_killed_fails_on_every_survivor_naming_its_address(distlib_cluster):
    cluster = distlib_cluster(nodes=3)
    result = cluster.run(Job.script(JOB, env={"STEPS": "100000", "GROUP_TIMEOUT": "20"}),
                         [(cues.Output(r"^torch_steps: rank 2 step 20$", node="node2"), faults.KillNode(2))],
                         deadline=180)
    result.assert_no_hang()
    victim = result.hosts["node2"].address
    for r in (0, 1):
        rec = result.ranks[r]
        assert rec.exception_type is not None, rec.summary()
        assert victim in rec.exception_text or "rank 2" in rec.exception_text, rec.summary()


def test_a_torch_job_is_broken_on_a_store_cue_its_ranks_give_the_master(distlib_cluster):
    """The master service hears torch's TCPStore clients too: node2 held back, the master is
    killed once ranks 0 and 1 wait on its keys; both fail with torch's lost-server error."""
    cluster = distlib_cluster(nodes=3)
    both_wait = cues.AllOf(cues.StoreOp("/default_pg/*", op="wait", node="node0"),
                           cues.StoreOp("/default_pg/*", op="wait", node="node1"))
    result = cluster.run(Job.script(JOB, env={"STEPS": "10", "GROUP_TIMEOUT": "60"}),
                         [(both_wait, faults.KillMaster())], held=[2], deadline=120)
    # torch's texts for a server that died: a closed connection, or a reset when the kill found
    # bytes of the client's unread (CI saw both)
    lost = re.compile(r"remote server shutdown or crash|Connection reset by peer")
    result.assert_survivors_raised("DistNetworkError", naming=lost, victims=[2])
    assert result.ranks[0].store_ops and result.ranks[0].store_ops[-1][1] in ("wait", "get"), result.ranks[0].store_ops
