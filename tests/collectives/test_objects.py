"""Object collectives (pickled payloads)."""

from . import cases


def test_object_collectives(pool):
    for rank, results in enumerate(pool.run(cases.object_cases)):
        assert all(results.values()), f"rank {rank}: {results}"
