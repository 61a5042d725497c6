"""A user's ``backend="nccl"`` job on CPU: the harness's fake device (distlib/testing/fake_gpu)
under distlib's nccl backend and as ``cupy``, with correct numbers, on namespaced hosts and in
containers."""

import pytest

from distlib.testing import Job, cues, faults

pytestmark = pytest.mark.distlib_substrates("processes", "containers")

JOB = "tests/testing/jobs/nccl_steps.py"


def test_an_nccl_job_on_cupy_arrays_runs_on_three_cpu_hosts_with_correct_numbers(hosts):
    result = hosts(nodes=3).run(Job.script(JOB, env={"STEPS": "10"}, fake_gpus=1), deadline=180)
    result.assert_ok(world_size=3)
    for r in range(3):
        assert f"nccl_steps: rank {r}/3 ok host=node{r} sum=30 device=cupy" in result.ranks[r].output, \
            result.ranks[r].output[-3:]
        assert result.ranks[r].last_collective == (11, "broadcast"), result.ranks[r].summary()


def test_an_nccl_job_whose_rank_is_killed_at_a_collective_fails_on_the_survivors_naming_it(hosts):
    """Stream-ordered, as on a GPU: the survivors' collective #5 times out on the device and
    the communicator is aborted; the next call raises, naming the rank that never reached #5
    (NO_CHECK: the job does not look at #5's result, which the abort left unwritten)."""
    job = Job.script(JOB, env={"STEPS": "100000", "GROUP_TIMEOUT": "5", "NO_CHECK": "1"}, fake_gpus=1)
    result = hosts(nodes=3).run(job, [(cues.Collective(1, 5), faults.KillNode(1))], deadline=180)
    assert result.ranks[1].last_collective == (5, "all_reduce"), result.report()
    result.assert_survivors_raised("DistBackendError", naming="had not reached #5: rank 1 on node1", victims=[1])
