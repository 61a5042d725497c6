"""The ring's pipelining with small pieces and a small scratch budget: every chunk is cut into
many pieces, and the reduce steps posted ahead are limited to a window smaller than the ring
(the paths that the default 4 MiB pieces and 256 MiB scratch only take on large arrays).
Results are checked against numpy on every rank."""

import pytest

from . import cases
from .harness import WorkerPool

# 16 KiB pieces; 1 MiB of scratch: 300_007 float64 over 4 ranks is a 600 KB chunk, so the
# window is 2 reduce steps of the 3, and a 1_000_003-element array takes the fresh-buffer path.
ENV = {"DISTLIB_SHM": "0"}
CONSTANTS = {"distlib.backends.gloo.algorithms.context.PIPE_BYTES": 16 << 10, "distlib.backends.gloo.algorithms.context.SCRATCH_LIMIT": 1 << 20}
SIZES = [70_001, 300_007, 1_000_003]


@pytest.fixture(scope="module", params=[2, 4], ids=lambda ws: f"ws{ws}")
def small_pieces_pool(request):
    pool = WorkerPool(request.param, env=ENV, constants=CONSTANTS)
    yield pool
    pool.close()


def test_the_ranks_run_with_small_pieces(small_pieces_pool):
    assert small_pieces_pool.run(cases.pipelining_settings) == [(16 << 10, 1 << 20)] * small_pieces_pool.world_size


@pytest.mark.parametrize("op_name", ["SUM", "MAX"])
def test_all_reduce_in_small_pieces_matches_numpy(small_pieces_pool, op_name):
    per_rank = small_pieces_pool.run(cases.all_reduce_matrix, op_name, ["float64", "int32"], SIZES)
    wrong = [(rank, dtype, n) for rank, rows in enumerate(per_rank) for dtype, n, ok, _ in rows if not ok]
    assert not wrong, wrong
    assert len(per_rank[0]) == 2 * len(SIZES)
    assert all([d for *_, d in rows] == [d for *_, d in per_rank[0]] for rows in per_rank)


def test_reduce_scatter_reduce_and_broadcast_in_small_pieces(small_pieces_pool):
    pool = small_pieces_pool
    for rank, rows in enumerate(pool.run(cases.reduce_scatter_matrix, "SUM", ["float32"], [100_003])):
        assert all(ok and ok2 for _, _, ok, ok2 in rows), (rank, rows)
    for rank, rows in enumerate(pool.run(cases.reduce_matrix, "SUM", ["float64"], SIZES, pool.world_size - 1)):
        assert all(ok for *_, ok in rows), (rank, rows)
    for rank, rows in enumerate(pool.run(cases.broadcast_cases, ["float32"], [1_000_003])):
        assert rows and all(ok is True for *_, ok in rows), (rank, rows)
