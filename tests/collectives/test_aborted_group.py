"""A group that failed stays failed (issue 37): after a mismatched collective, a timeout or an
abort, every later operation on that group raises on every rank, naming the first failure,
until the group is destroyed; the other groups go on. With shared memory (the small channel,
whose exchange needs no frame: two aborted ranks could meet in it and succeed) and over TCP."""

import pytest

from . import cases
from .harness import WorkerPool


@pytest.fixture(scope="module", params=[2, 3], ids=lambda ws: f"ws{ws}")
def tcp_pool(request):
    pool = WorkerPool(request.param, env={"DISTLIB_SHM": "0"})
    yield pool
    pool.close()


def check_stays_aborted(results, ws, how):
    succeeded = [(rank, name) for rank, (_, later, _) in enumerate(results) for name, text in later
                 if text == "no error"]
    assert succeeded == [], f"after the {how}, these succeeded on the failed group (rank, operation): {succeeded}"
    for rank, (first, later, check) in enumerate(results):
        assert first != "no error", f"rank {rank}: the {how} raised nothing"
        for name, text in later:
            assert "aborted by an earlier failure" in text and first in text, \
                f"rank {rank}: {name} after the {how} did not name the first failure ({first!r}): {text!r}"
        assert check == ws, f"rank {rank}: the default group does not work after destroying the failed one"


@pytest.mark.parametrize("pool", [2, 3], indirect=True, ids=lambda ws: f"ws{ws}")
@pytest.mark.parametrize("how", ["mismatch", "timeout", "abort"])
def test_a_failed_group_refuses_every_later_operation_on_every_rank(pool, how):
    results = pool.run(cases.stays_aborted, how)
    if how == "abort":
        assert results[0] == ("aborted by this rank", [], pool.world_size)
        results = results[1:]  # rank 0 aborted it: the others must refuse, and say why
    check_stays_aborted(results, pool.world_size, how)


@pytest.mark.parametrize("how", ["mismatch", "timeout"])
def test_a_failed_group_refuses_every_later_operation_over_tcp(tcp_pool, how):
    check_stays_aborted(tcp_pool.run(cases.stays_aborted, how), tcp_pool.world_size, how)
