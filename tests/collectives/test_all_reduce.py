"""all_reduce: every ReduceOp x every dtype x sizes (empty, one element, counts not divisible
by the world size, sizes that take each path) x world sizes 1-4, each checked on every rank
against a numpy reference, and bit-identical across ranks; and each path it claims is taken.

Two pools per world size: the default one (every rank on this host, shared memory on), where
every all_reduce goes through the small channel or the large shared segment, and one with
DISTLIB_SHM=0, where every all_reduce goes over TCP: the direct exchange (or the tree when the
machine runs more ranks than it has CPUs) for small arrays, the ring for large ones. Each
all_reduce reports the path it took (cases.all_reduce_matrix_traced), so a routing change that
sends them elsewhere fails here, naming the (dtype, size) and the path.
"""

import pytest

from distlib.backends.gloo.transport import shm_channel

from . import cases
from .harness import WorkerPool

OPS = ["SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "AVG", "PREMUL_SUM"]
#: The mesh's algorithms for arrays that fit in one round (or log2 n rounds).
LATENCY_BOUND = {"direct", "tree", "recursive_doubling"}


@pytest.fixture(scope="module", params=[2, 3, 4], ids=lambda ws: f"ws{ws}")
def tcp_pool(request):
    """Ranks on this host with shared memory off: everything over the TCP mesh."""
    pool = WorkerPool(request.param, env={"DISTLIB_SHM": "0"})
    yield pool
    pool.close()


def checked_paths(pool, op_name):
    """Run the matrix on ``pool``; assert every result; the set of paths taken, by path."""
    per_rank = pool.run(cases.all_reduce_matrix_traced, op_name, cases.ALL_DTYPES, cases.SIZES)
    wrong = [(rank, dtype, n) for rank, rows in enumerate(per_rank) for dtype, n, ok, _, _ in rows if not ok]
    assert not wrong, f"{op_name}: results differ from numpy at (rank, dtype, size): {wrong[:10]}"
    digests = [[d for _, _, _, d, _ in rows] for rows in per_rank]
    assert all(d == digests[0] for d in digests), f"{op_name}: ranks hold different results"
    assert len(per_rank[0]) == sum(cases.valid(op_name, d) for d in cases.ALL_DTYPES) * len(cases.SIZES)
    paths = {}
    for rank, rows in enumerate(per_rank):
        for dtype, n, _, _, path in rows:
            paths.setdefault(path, []).append((rank, dtype, n))
    return paths


@pytest.mark.parametrize("op_name", OPS)
def test_all_reduce_matches_numpy(pool, op_name):
    paths = checked_paths(pool, op_name)
    if pool.world_size == 1:
        assert set(paths) == {""}, f"a group of one sends nothing, but went: {sorted(paths)}"
    elif shm_channel.supported():
        assert set(paths) == {"small", "segment"}, \
            f"{op_name}: with every rank on this host, all_reduce goes through shared memory; went: " \
            f"{ {p: seen[:3] for p, seen in paths.items()} }"


@pytest.mark.parametrize("op_name", OPS)
def test_all_reduce_over_tcp_matches_numpy(tcp_pool, op_name):
    paths = checked_paths(tcp_pool, op_name)
    shown = {p: seen[:3] for p, seen in paths.items()}
    assert "ring" in paths and set(paths) & LATENCY_BOUND, \
        f"{op_name}: over TCP, large arrays go round the ring and small ones in one round; went: {shown}"
    assert set(paths) <= LATENCY_BOUND | {"ring"}, f"{op_name}: with DISTLIB_SHM=0 nothing may use shared memory: {shown}"
    if tcp_pool.world_size == 2:
        assert "direct" in paths, f"{op_name}: two ranks exchange small arrays directly; went: {shown}"
