"""send/recv, any-source recv, isend/irecv in either order (no deadlock), tags, batch_isend_irecv."""

from . import cases


def test_point_to_point(pool):
    per_rank = pool.run(cases.p2p_cases)
    for rank, results in enumerate(per_rank):
        assert all(results.values()), f"rank {rank}: {results}"
    if pool.world_size > 1:
        assert "tags" in per_rank[0] and "any_source" in per_rank[0]
