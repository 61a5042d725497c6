"""Groups: queries, subgroups (with a rank outside), init -> destroy -> init, a third-party
backend, and init_process_group's timeout naming the ranks that never came."""

import os

import pytest

import distlib as dist

from . import cases, group_cases
from .harness import spawn
from tests.fixtures.ports import free_port


def ok(results):
    for rank, (code, (status, value)) in enumerate(results):
        assert status == "ok", f"rank {rank} (exit {code}):\n{value}"
    return [value for _, (_, value) in results]


def test_world_queries(pool):
    for rank, info in enumerate(pool.run(cases.world_info)):
        assert info == {"rank": rank, "size": pool.world_size, "backend": "gloo", "initialized": True,
                        "world_is_default": True, "progress_threads_alive": True}


@pytest.mark.parametrize("pool", [3, 4], indirect=True, ids=lambda ws: f"ws{ws}")
def test_subgroup_with_a_rank_outside(pool):
    ws = pool.world_size
    members = [0, ws - 1]
    for rank, r in enumerate(pool.run(cases.subgroup_cases, members)):
        if rank in members:
            assert r["sum"] == sum(members) and r["group_size"] == 2 and r["ranks"] == members
            assert r["group_rank"] == members.index(rank) and r["global_of_0"] == 0
            assert r["group_of_me"] == members.index(rank) and r["broadcast"] == float(ws - 1)
        else:
            assert r["is_non_member"] and r["rank"] == -1 and r["size"] == -1
            assert r["collective_returns"] is None and r["warned"]


def test_init_destroy_init_in_one_process(tmp_path):
    results = ok(spawn(group_cases.init_destroy_init, 2, str(tmp_path / "a"), str(tmp_path / "b")))
    for value in results:
        assert value == [(True, 3.0, "gloo", 2.0), False, True, (True, 3.0, "gloo", 2.0), False, True]


def test_reinit_after_a_failed_collective(tmp_path):
    results = ok(spawn(group_cases.after_failure_reinit, 2, str(tmp_path / "a"), str(tmp_path / "b")))
    assert results == [(True, 2.0), (True, 2.0)]


def test_third_party_backend_plugin(tmp_path):
    results = ok(spawn(group_cases.use_plugin, 3, str(tmp_path / "store")))
    for values, backend, attr, unsupported in results:
        assert values == [0.0, 3.0, 6.0, 9.0]
        assert backend == "storebackend" and attr == "storebackend"
        assert "does not implement broadcast" in unsupported


def test_init_timeout_names_the_missing_rank():
    """Rank 0 (it hosts the store) names the rank that never came and its node; the others
    either time out the same way or see the store go and say where the answer is."""
    results = ok(spawn(group_cases.join_with_missing_rank, 3, free_port()))
    text, elapsed = results[0]
    assert "never arrived: rank 3 expected on node 0" in text and "3/4 joined" in text, text
    for rank, (text, elapsed) in enumerate(results):
        assert elapsed < 4 + 10, f"rank {rank} took {elapsed:.1f}s for a 4s timeout"
        assert "never arrived: rank 3" in text or "its error names the ranks that never arrived" in text, text


def test_backend_strings_and_config():
    from distlib.backends.registry import backend_config

    assert dist.Backend("GLOO") == "gloo" == dist.Backend.GLOO
    assert backend_config("gloo", ["cpu"]) == {"cpu": "gloo", "cuda": "gloo"}
    assert backend_config("cpu:GLOO,cuda:nccl", ["cpu"]) == {"cpu": "gloo", "cuda": "nccl"}
    assert backend_config("undefined", ["cpu"]) == {"cpu": "gloo"}
    with pytest.raises(ValueError, match="Invalid device:backend pairing"):
        backend_config("cpu:gloo,", ["cpu"])
    with pytest.raises(ValueError, match="Duplicate device type cpu"):
        backend_config("cpu:gloo,cpu:nccl", ["cpu"])
    with pytest.raises(ValueError, match="string-ish"):
        dist.Backend(3)


def test_availability():
    assert dist.is_available() and dist.is_gloo_available()
    assert not dist.is_ucc_available()  # mpi: tests/mpi/test_availability.py; nccl: tests/gpu/test_availability.py
    assert not dist.is_initialized()


def test_init_argument_errors():
    with pytest.raises(ValueError, match="Cannot specify both init_method and store"):
        dist.init_process_group("gloo", init_method="env://", store=dist.HashStore(), world_size=1, rank=0)
    with pytest.raises(ValueError, match="world_size must be positive"):
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0)
    with pytest.raises(TypeError, match="timedelta"):
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=30)
    with pytest.raises(ValueError, match="RANK expected"):
        env = {k: os.environ.pop(k) for k in ("RANK", "WORLD_SIZE") if k in os.environ}
        try:
            dist.init_process_group("gloo", init_method="env://")
        finally:
            os.environ.update(env)
    assert not dist.is_initialized()


def test_single_rank_with_a_user_store():
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        a = dist.get_world_size(), dist.get_rank()
        with pytest.raises(ValueError, match="twice"):
            dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    finally:
        dist.destroy_process_group()
    assert a == (1, 0)


def test_monitored_barrier_names_the_absent_rank(tmp_path):
    results = ok(spawn(group_cases.monitored_barrier_with_absent_rank, 3, str(tmp_path / "s"), 2))
    text, elapsed = results[0]
    assert "Ranks 2 failed to pass monitoredBarrier in 2000 ms" in text, text
    assert elapsed < 6
    assert "monitored_barrier failed" in results[1][0], results[1]


def test_failing_async_operation_reports_on_its_work(tmp_path):
    for raised, completed, success, same, future_raised in ok(spawn(group_cases.failing_async_op, 2,
                                                                    str(tmp_path / "s"))):
        assert raised and "mismatched collective" in raised
        assert completed and not success and same and future_raised
