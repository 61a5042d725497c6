"""A rank that dies or stalls: the job ends within a bound, no rank is left behind, and the
output names the dead rank (Open MPI's mpirun) or says what the others waited for (distlib's
watchdog, after the group timeout)."""

import re
import time

import pytest

from .launch import is_open_mpi


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


def _left_running(pids, grace: float = 10.0):
    """The pids still running ``grace`` seconds after mpirun returned (it may return while
    its daemon is still reaping the ranks)."""
    deadline = time.monotonic() + grace
    while True:
        running = [p for p in pids if _alive(p)]
        if not running or time.monotonic() > deadline:
            return running
        time.sleep(0.1)


def _one_line(text: str) -> str:
    return " ".join(text.split())


@pytest.fixture
def open_mpi(mpi_ready):
    if not is_open_mpi():
        pytest.skip("the expected texts are Open MPI's mpirun's")


def test_a_killed_rank_ends_the_job_and_mpirun_names_it(open_mpi, suites):
    """Rank 1 SIGKILLs itself in the middle of a loop of all_reduce: mpirun stops the other
    ranks (blocked in MPI_Allreduce waiting for it) and says which rank died and how."""
    job = suites("killed", 3)
    text = _one_line(job.output)
    assert job.returncode != 0, text
    assert re.search(r"process rank 1 with PID \d+ on node \S+ exited on signal 9 \(Killed\)", text), text
    assert job.seconds < 60, f"the job took {job.seconds:.0f}s to end"
    pids = [values[1] for values in (r.get("pids") for r in job.results) if values and values[0] == "ok"]
    assert len(pids) == 3 and not _left_running(pids), f"ranks left running: {pids}"
    for rank in (0, 2):
        assert "killed_mid_all_reduce" not in job.results[rank], "a survivor finished a collective with a dead peer"


def test_a_stalled_rank_is_named_and_the_watchdog_ends_the_job_after_the_group_timeout(open_mpi, suites, tmp_path):
    """Rank 2 stays in its own code; ranks 0 and 1 wait in all_reduce. After the group timeout
    (3 s) their watchdogs ask every rank what it is doing, say what they waited for, on which
    group and hosts, and that rank 2 is in its own code, and abort the job: nobody hangs, the
    stalled rank included."""
    from .launch import run_job

    job = run_job(3, "stall", tmp_path / "stall", timeout=120, extra=["--timeout", "3"])
    text = _one_line(job.output)
    assert job.seconds < 3 + 25, f"the job took {job.seconds:.0f}s to end"
    assert job.returncode == 62, (job.returncode, text[-3000:])
    reports = re.findall(r"distlib mpi: rank (\d) of MPI_COMM_WORLD \(host \S+, pid \d+\): all_reduce of 4 x float32 "
                         r"\(op #1\) on group pg0/mpi \(ranks 0-2 on \S+\) did not finish within the group timeout "
                         r"\(3\.0s\)\. Not there: rank 2 \(host \S+\) is not in an MPI call: it has been in its own "
                         r"code for [\d.]+s \(its last MPI call: [^;]*\); waiting in it too: rank (\d)", text)
    assert reports and all({a, b} == {"0", "1"} for a, b in reports), text[-3000:]
    assert "MPI_ABORT was invoked on rank" in text and "Errorcode: 62" in text, text[-3000:]
    pids = [r["pids"][1] for r in job.results if "pids" in r]
    assert len(pids) == 3 and not _left_running(pids), f"ranks left running: {pids}"


def test_a_rank_in_another_collective_is_named_with_what_it_runs(open_mpi, suites, tmp_path):
    """Rank 2 broadcasts while ranks 0 and 1 all_reduce: MPI does not notice; after the group
    timeout the waiting ranks' watchdogs name rank 2 and the operation it is in."""
    from .launch import run_job

    # rank 2's own timeout is 60 s: ranks 0 and 1's watchdogs expire first, whatever the load
    job = run_job(3, "mismatch", tmp_path / "mismatch", timeout=120,
                  extra=["--timeout", "3", "--last-rank-timeout", "60"])
    text = _one_line(job.output)
    assert job.returncode == 62 and job.seconds < 3 + 25, (job.returncode, job.seconds, text[-3000:])
    assert re.search(r"all_reduce of 4 x float32 \(op #1\) on group pg0/mpi \(ranks 0-2 on \S+\) did not finish "
                     r"within the group timeout \(3\.0s\)\. Not there: rank 2 \(host \S+\) is waiting in another "
                     r"operation: broadcast of 4 x float32 \(op #1\) on pg0/mpi for [\d.]+s", text), text[-3000:]
    pids = [r["pids"][1] for r in job.results if "pids" in r]
    assert len(pids) == 3 and not _left_running(pids), f"ranks left running: {pids}"


def test_exiting_with_an_operation_in_flight_aborts_instead_of_hanging_in_finalize(open_mpi, suites):
    """MPI_Finalize would wait for the all_reduce rank 0 left running; distlib's exit hook
    names it and aborts the job."""
    job = suites("exit_pending", 2)
    text = _one_line(job.output)
    assert job.returncode == 62, (job.returncode, text[-3000:])
    assert job.seconds < 30, f"the job took {job.seconds:.0f}s to end"
    assert ("rank 0 of MPI_COMM_WORLD" in text and "exiting while 1 MPI operation(s) are still in flight "
            "(all_reduce of 4 x float64 on pg0/mpi)" in text), text[-3000:]
    assert job.case("left_in_flight") == ["returned", "returned"]


def test_a_rank_that_saw_a_mismatch_refuses_the_group_and_the_others_are_told_why(open_mpi, tmp_path):
    """all_reduce of float32[4] against float32[8] at 2 ranks (issue 37): MPI reports it
    (MPI_ERR_TRUNCATE) on the rank that posted less, and is silent on the other. The rank that
    saw it refuses every later operation on the group at once, naming it (MPI cannot tell the
    other rank, and cannot cancel a call); the other rank's next all_reduce waits for it, and
    after the group timeout its watchdog ends the job saying that the failed rank refuses the
    group, and why."""
    from .launch import run_job

    job = run_job(2, "aborted", tmp_path / "aborted", timeout=120, extra=["--timeout", "3"])
    text = _one_line(job.output)
    outcomes = job.case("mismatch_stays_aborted")
    failed = [rank for rank, (first, _) in enumerate(outcomes) if first != "no error"]
    assert failed, f"MPI reported the mismatch on no rank: {outcomes}"
    for rank in failed:
        first, later = outcomes[rank]
        assert "failed in MPI" in first, f"rank {rank}: {first!r}"
        succeeded = [name for name, error in later if error == "no error"]
        assert succeeded == [], f"rank {rank}: these succeeded on the group it had seen fail: {succeeded}"
        for name, error in later:
            assert "aborted by an earlier failure" in error and first in error, f"rank {rank}, {name}: {error!r}"
    assert job.returncode == 62 and job.seconds < 3 + 25, (job.returncode, job.seconds, text[-3000:])
    for rank in failed:
        assert re.search(rf"rank {rank} \(host \S+\) refuses every operation of pg0/mpi since it failed there: "
                         rf"pg0/mpi: rank {rank}: all_reduce of \d+ x float32 failed in MPI", text), text[-3000:]
    pids = [r["pids"][1] for r in job.results if "pids" in r]
    assert len(pids) == 2 and not _left_running(pids), f"ranks left running: {pids}"
