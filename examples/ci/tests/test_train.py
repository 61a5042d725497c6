"""train.py on several hosts, under faults, as CI runs it (README.md).

Each test starts a cluster with the ``distlib_cluster`` fixture (the distlib.testing plugin),
runs the job, and asserts on every rank's record.
"""

import os
import re

import pytest

from distlib.testing import Job, Schedule, cues, faults


def train(*args: str, **env: str) -> Job:
    return Job.script("train.py", *args, env=env)


@pytest.mark.distlib_substrates("processes", "containers")
def test_a_clean_run_on_three_hosts(distlib_cluster):
    result = distlib_cluster(nodes=3).run(train("--steps", "60"), deadline=180)
    result.assert_ok(world_size=3)
    for rank, record in result.ranks.items():
        assert any(f"train: rank {rank}/3 on node{rank} " in line for line in record.output), record.output[-5:]
        assert any(f"train: rank {rank}/3 done" in line for line in record.output), record.output[-5:]


def test_a_node_killed_at_collective_k_is_named_by_every_survivor(distlib_cluster):
    cluster = distlib_cluster(nodes=3)
    result = cluster.run(train("--steps", "5000", "--timeout", "30"),
                         [(cues.Collective(rank=2, n=20), faults.KillNode(2))], deadline=180)
    assert result.ranks[2].last_collective == (20, "all_reduce")  # it died exactly there
    result.assert_survivors_raised("DistBackendError", naming=2, victims=[2])


def test_a_partition_ends_in_a_timeout_that_names_the_silent_rank(distlib_cluster):
    cluster = distlib_cluster(nodes=3)
    result = cluster.run(train("--steps", "5000", "--timeout", "5"),
                         [(cues.Collective(rank=1, n=20), faults.Partition([0, 1], [2]))], deadline=180)
    result.assert_survivors_raised("DistBackendError", naming="rank 2 (", victims=[2])
    assert "timed out after 5.0s" in result.ranks[0].exception_text


def test_a_master_restarted_while_ranks_wait_in_init_fails_them_naming_it(distlib_cluster):
    """The master restarted, static half: a job without agents (ranks 0 and 1 wait in init for
    node2, held back) has nobody to wait the master out: the master restarts (empty: no
    keep_master_state) once it has seen both wait on the join keys. distlib's clients reconnect,
    see that the master came back without the keys it held (a new state), and fail at once
    naming it, well within their 60 s timeout."""
    cluster = distlib_cluster(nodes=3)
    both_wait = cues.AllOf(cues.StoreOp("*join*", op="wait", node="node0"), cues.StoreOp("*join*", op="wait", node="node1"))
    result = cluster.run(train("--steps", "20", "--timeout", "60"),
                         [(both_wait, faults.RestartMaster())], held=[2], deadline=180)
    result.assert_survivors_raised("DistStoreError", naming="master:29500", within=30, victims=[2])
    assert "came back without the keys it held" in result.ranks[0].exception_text


def test_an_elastic_job_whose_master_restarts_with_its_state_completes_in_the_same_round(distlib_cluster):
    """The master restarted, elastic half: distlib-run --nnodes 2:3 keeps its rounds on the
    master service, which journals them (keep_master_state: store-server --state-dir) and is
    SIGKILLed and started again at rank 0's collective #50. The agents keep the ranks training
    while it is away and go on in the same round once it is back: the job finishes with every
    rank, no restart, and every node says how long the master was away."""
    cluster = distlib_cluster(nodes=3)
    job = Job.launch(["train.py", "--steps", "300", "--timeout", "30"], nnodes="2:3", max_restarts=3,
                     rdzv_conf="keep_alive_interval=1,keep_alive_max_attempt=4,last_call_timeout=2")
    result = cluster.run(job, [(cues.Collective(rank=0, n=50), faults.RestartMaster())], deadline=180,
                         keep_master_state=True)
    result.assert_finished(world_size=3, restarts=0)
    for name in ("node0", "node1", "node2"):
        away = [line for line in result.hosts[name].output
                if re.search(r"the rendezvous store \(TCPStore server .*\) was away for [\d.]+ s in round 0", line)]
        assert away, f"{name} does not say the master was away:\n{result.hosts[name].tail()}"


def test_init_waits_for_a_master_whose_name_resolves_late(distlib_cluster):
    cluster = distlib_cluster(nodes=3)
    result = cluster.run(train("--steps", "20"), [(cues.After(0), faults.Unresolvable("master")),
                                                  (cues.After(3), faults.Resolvable("master"))], deadline=180)
    result.assert_ok(world_size=3)


def test_a_master_name_that_never_resolves_is_named_by_every_rank(distlib_cluster):
    cluster = distlib_cluster(nodes=2)
    result = cluster.run(train("--steps", "20", "--timeout", "6"),
                         [(cues.After(0), faults.Unresolvable("master"))], deadline=180)
    result.assert_survivors_raised(("DistNetworkError", "DistStoreError"), naming="master")


def survived_or_named(result) -> None:
    """What any fault schedule must leave: no hang, and every rank either finished or raised a
    distributed error that names a rank."""
    result.assert_no_hang()
    for rank, record in result.ranks.items():
        if record.exception_type is None:
            continue
        assert record.exception_type.startswith("Dist"), f"rank {rank}: {record.summary()}"
        assert "rank " in (record.exception_text or ""), record.summary()


def test_a_seeded_random_schedule_replays_from_its_file(distlib_cluster, tmp_path):
    seed = int(os.environ.get("SCHEDULE_SEED", "20261128"))
    schedule = Schedule.random(seed, ranks=3, collectives=40, steps=2, faults=("kill", "pause", "partition"))
    cluster = distlib_cluster(nodes=3)
    job = train("--steps", "300", "--timeout", "8")
    first = cluster.run(job, schedule, deadline=180)
    survived_or_named(first)
    saved = schedule.save(tmp_path / "schedule.json")
    again = cluster.run(job, Schedule.load(saved), deadline=180)
    survived_or_named(again)
    # the same faults at the same points of the job
    assert [(f["fault"], f["cue_event"]) for f in again.faults] == [(f["fault"], f["cue_event"]) for f in first.faults]
