"""The nccl backend and gloo's cupy path on a real GPU: every collective x op x dtype at world
size 1, and at 2 and 3 ranks sharing ONE GPU (each rank its own NCCL_HOSTID, see
gpu_cases.one_gpu_env); refusals before enqueueing; ordering against the caller's stream; a
rank killed mid all_reduce and a rank that never arrives; init -> destroy -> init; mixed
cpu:gloo,cuda:nccl groups. Without a device every test here skips, saying what cupy said."""

import pytest

from tests.collectives.harness import spawn

from . import gpu_cases
from .conftest import no_device_reason

_REASON = no_device_reason()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_REASON is not None, reason=_REASON or "")]


def ok(results):
    for rank, (code, outcome) in enumerate(results):
        assert outcome is not None, f"rank {rank} gave no answer (exit {code})"
        status, value = outcome
        assert status == "ok", f"rank {rank} (exit {code}):\n{value}"
    return [value for _, (_, value) in results]


@pytest.mark.parametrize("ws", [1, 2, 3])
def test_every_collective_op_and_dtype(ws, tmp_path):
    for rank, problems in enumerate(ok(spawn(gpu_cases.every_collective, ws, str(tmp_path / "s"), timeout=900))):
        assert problems == [], "\n".join(problems[:40])


@pytest.mark.parametrize("ws", [1, 2])
def test_refusals_come_before_anything_is_enqueued(ws, tmp_path):
    for rank, (seen, still) in enumerate(ok(spawn(gpu_cases.refusals, ws, str(tmp_path / "s"), timeout=300))):
        assert gpu_cases.refusal_problems(seen, still, ws) == [], f"rank {rank}"


@pytest.mark.parametrize("ws", [1, 2])
def test_ordering_against_the_callers_stream(ws, tmp_path):
    assert ok(spawn(gpu_cases.async_ordering, ws, str(tmp_path / "s"), timeout=300)) == [[True, True]] * ws


def test_init_destroy_init(tmp_path):
    for rank, out in enumerate(ok(spawn(gpu_cases.init_destroy_init, 2, str(tmp_path / "a"), str(tmp_path / "b"),
                                        timeout=300))):
        assert out == [3.0, [], 3.0, []], f"rank {rank}: {out}"


def test_backend_none_is_cpu_gloo_cuda_nccl(tmp_path):
    for rank, answer in enumerate(ok(spawn(gpu_cases.mixed_group, 2, str(tmp_path / "s"), timeout=300))):
        assert answer == ("cpu:gloo,cuda:nccl", 3.0, 3.0, [0, 1], "gloo", "nccl", True), f"rank {rank}"


def test_lazy_communicators_local_rank_and_subgroups(tmp_path):
    for answer in ok(spawn(gpu_cases.lazy_and_bound, 2, str(tmp_path / "s"), timeout=300)):
        assert answer == (True, True, True, 3.0)


@pytest.mark.parametrize("ws", [2, 3])
def test_gloo_takes_cupy_arrays(ws, tmp_path):
    for problems in ok(spawn(gpu_cases.gloo_with_cupy, ws, str(tmp_path / "s"), timeout=300)):
        assert problems == [], "\n".join(problems)


def test_a_rank_killed_mid_all_reduce_is_named(tmp_path):
    ws, victim = 3, 2
    results = spawn(gpu_cases.killed_mid_all_reduce, ws, str(tmp_path / "s"), victim, timeout=300)
    assert results[victim][0] == 1
    for rank in (0, 1):
        code, (status, value) = results[rank]
        assert status == "ok" and code == 0, (rank, code, value)
        text, elapsed = value
        assert "all_reduce of 4194304 x float32 on cuda:0 (collective #3 in this group)" in text, text
        assert f"rank {victim} on " in text, text
        assert elapsed < 20 + 15, f"rank {rank} needed {elapsed:.1f}s for a 20s timeout"


def test_a_rank_that_never_arrives_is_named_after_the_timeout(tmp_path):
    ws, laggard = 3, 1
    results = ok(spawn(gpu_cases.silent_rank, ws, str(tmp_path / "s"), laggard, timeout=300))
    for rank, value in enumerate(results):
        if rank == laggard:
            continue
        text, elapsed, same_again = value
        assert "(collective #3 in this group) timed out after" in text, text
        assert f"Ranks that had not reached #3: rank {laggard} on " in text and "last issued #2" in text, text
        assert 10 <= elapsed < 10 + 15, elapsed
        assert same_again, "the next call must raise the same error"
