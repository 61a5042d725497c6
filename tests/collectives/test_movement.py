"""broadcast, all_gather, all_gather_into_tensor, gather, scatter, all_to_all(_single), barriers."""

import pytest

from . import cases


def test_broadcast_from_first_and_last(pool):
    per_rank = pool.run(cases.broadcast_cases, ["bool", "int16", "float32", "complex128"],
                        [0, 1, 1003, 300_007])
    wrong = [row for rows in per_rank for row in rows if not row[-1]]
    assert not wrong, f"broadcast wrong at (root, dtype, size): {wrong[:10]}"


@pytest.mark.parametrize("dtype,n", [("int32", 0), ("float64", 1), ("uint8", 1003), ("float32", 70_001)])
def test_gather_family(pool, dtype, n):
    for rank, results in enumerate(pool.run(cases.gather_family, dtype, n)):
        assert all(results.values()), f"rank {rank}: {results}"


@pytest.mark.parametrize("dtype,n", [("int64", 1), ("float32", 4097)])
def test_all_to_all(pool, dtype, n):
    for rank, results in enumerate(pool.run(cases.all_to_all_cases, dtype, n)):
        assert all(results.values()), f"rank {rank}: {results}"


def test_barriers(pool):
    assert pool.run(cases.barrier_cases) == [True] * pool.world_size
