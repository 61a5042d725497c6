"""The process substrate without namespaces (a runner with no root): hosts share this machine's
name and loopback address; kills, pauses, cues, records and the deadline report still work."""

from distlib.testing import Job, cues, faults

STEPS = "tests/testing/jobs/steps.py"


def test_a_clean_run_and_a_kill_at_a_collective_on_loopback_hosts(distlib_cluster):
    cluster = distlib_cluster(nodes=3, namespaces=False)
    assert "network" not in cluster.substrate.abilities and "signals" in cluster.substrate.abilities
    cluster.run(Job.script(STEPS, env={"STEPS": "5"}), deadline=120).assert_ok(world_size=3)
    result = cluster.run(Job.script(STEPS, env={"STEPS": "500", "GROUP_TIMEOUT": "30"}),
                         [(cues.Collective(1, 6), faults.KillNode(1))], deadline=120)
    assert result.ranks[1].last_collective == (6, "all_reduce"), result.report()
    result.assert_survivors_raised("DistBackendError", naming=1, victims=[1])


def test_a_hang_on_loopback_hosts_is_reported_with_stacks_and_ended(distlib_cluster):
    cluster = distlib_cluster(nodes=2, namespaces=False)
    result = cluster.run(Job.script(STEPS, env={"STEPS": "100000", "GROUP_TIMEOUT": "600"}),
                         [(cues.Collective(1, 2), faults.Pause(1))], deadline=6)
    assert "rank 1: last entered collective #2 (all_reduce)" in result.hang, result.hang
    assert "stacks of node1" in result.hang and "steps.py" in result.hang, result.hang
    assert all(h.poll() is not None for h in cluster.substrate.hosts.values())
