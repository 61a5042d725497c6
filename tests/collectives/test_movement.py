"""broadcast, all_gather, all_gather_into_tensor, gather, scatter, all_to_all(_single), barriers."""

import numpy as np
import pytest

from . import cases


def test_broadcast_from_first_and_last(pool):
    per_rank = pool.run(cases.broadcast_cases, ["bool", "int16", "float32", "complex128"],
                        [0, 1, 1003, 300_007])
    wrong = [row for rows in per_rank for row in rows if row[-1] is not True]
    assert not wrong, f"broadcast wrong at (root, dtype, size, what): {wrong[:10]}"


@pytest.mark.parametrize("dtype,n", [("int32", 0), ("float64", 1), ("uint8", 1003), ("float32", 70_001)])
def test_gather_family(pool, dtype, n):
    for rank, results in enumerate(pool.run(cases.gather_family, dtype, n)):
        assert cases.wrong(results) == {}, f"rank {rank}: {cases.wrong(results)}"


@pytest.mark.parametrize("dtype,n", [("int64", 1), ("float32", 4097)])
def test_all_to_all(pool, dtype, n):
    for rank, results in enumerate(pool.run(cases.all_to_all_cases, dtype, n)):
        assert cases.wrong(results) == {}, f"rank {rank}: {cases.wrong(results)}"


def test_barriers_hold_every_rank_until_the_last_arrives(pool):
    """Rank r arrives r x 50 ms late: every rank must leave after the last one arrived."""
    early = cases.left_before_the_last_arrived(pool.run(cases.barrier_cases, 0.05))
    assert early == {}, f"ranks that left a barrier before the last rank arrived (seconds before): {early}"


def test_barriers_over_tcp_hold_every_rank_too():
    """The same with the small shared-memory channel off: the mesh's barrier algorithms."""
    from .harness import WorkerPool

    pool = WorkerPool(3, env={"DISTLIB_SHM": "0"})
    try:
        early = cases.left_before_the_last_arrived(pool.run(cases.barrier_cases, 0.05))
    finally:
        pool.close()
    assert early == {}, f"ranks that left a barrier before the last rank arrived (seconds before): {early}"


def test_a_wrong_result_says_where():
    assert cases.first_wrong(np.arange(4), np.arange(4)) is True
    assert cases.first_wrong(np.array([0, 1, 7, 9]), np.arange(4), "root 2, from rank 1: ") == \
        "root 2, from rank 1: element 2 is 7, expected 2 (2 of 4 wrong)"
    assert cases.first_wrong(np.arange(3), np.arange(4)) == "shape (3,), expected (4,)"
    assert cases.wrong({"gather": True, "scatter": "root 1: element 0 is 5, expected 4 (1 of 1 wrong)"}) == {
        "scatter": "root 1: element 0 is 5, expected 4 (1 of 1 wrong)"}


def test_the_barrier_check_sees_a_rank_that_did_not_wait():
    held = {kind: (1.0, 1.3) for kind in cases.BARRIER_KINDS}
    late = {kind: (1.2, 1.3) for kind in cases.BARRIER_KINDS}
    gone = dict(held, barrier=(1.0, 1.1))  # left the plain barrier before rank 1 arrived
    assert cases.left_before_the_last_arrived([held, late]) == {}
    assert cases.left_before_the_last_arrived([gone, late]) == {"barrier": {0: 0.1}}
