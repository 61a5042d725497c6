"""The nccl backend and gloo's cupy path on a real GPU: every collective x op x dtype at world
size 1, and at 2 and 3 ranks sharing ONE GPU (each rank its own NCCL_HOSTID, see
gpu_cases.one_gpu_env); refusals before enqueueing; ordering against the caller's stream; a
rank killed mid all_reduce, a rank that goes silent (fake_cases, also run on the fake device
by test_nccl_fake.py); destroy keeping results; init -> destroy -> init; mixed
cpu:gloo,cuda:nccl groups. Without a device every test here skips, saying what cupy said."""

import pytest

from tests.collectives.harness import spawn
from tests.fixtures.ports import free_port

from . import fake_cases, gpu_cases
from .conftest import no_device_reason

_REASON = no_device_reason()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_REASON is not None, reason=_REASON or "")]


def ok(results):
    for rank, (code, outcome) in enumerate(results):
        died = f"died of signal {-code}: its stderr has every thread's stack" if code is not None and code < 0 \
            else f"exit {code}"
        assert outcome is not None, f"rank {rank} gave no answer ({died})"
        status, value = outcome
        assert status == "ok", f"rank {rank} (exit {code}):\n{value}"
    return [value for _, (_, value) in results]


@pytest.mark.parametrize("ws", [1, 2, 3])
def test_every_collective_op_and_dtype(ws, tmp_path):
    for rank, problems in enumerate(ok(spawn(gpu_cases.every_collective, ws, str(tmp_path / "s"), timeout=900))):
        assert problems == [], f"rank {rank}:\n" + "\n".join(problems[:40])


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


#: (how, world size, store, device_id): the case that crashed on an H200 (3 ranks, file://,
#: eager), the one that worked (2, env://, lazy), survivors that keep enqueueing, a rank that exits.
SILENT = [("barrier", 3, "file", 0), ("barrier", 2, "env", None), ("loop", 3, "env", None), ("loop", 2, "file", 0),
          ("exit", 3, "file", None)]


@pytest.mark.parametrize("how,ws,store,device_id", SILENT,
                         ids=[f"{h}-ws{w}-{s}-{'eager' if d == 0 else 'lazy'}" for h, w, s, d in SILENT])
def test_a_silent_rank_is_named_and_nobody_crashes_or_hangs(how, ws, store, device_id, tmp_path):
    """fake_cases.silent_rank on the GPU (test_nccl_fake.py runs it on the fake device): rank 1
    goes silent after #2; the others raise the watchdog's error naming it, again on the next
    call, and every destroy returns. A native crash prints every thread's stack (faulthandler)."""
    laggard, timeout_s = 1, 10.0
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())} if store == "env" else {}
    results = spawn(fake_cases.silent_rank, ws, f"gpu:{tmp_path}", store, device_id, laggard, how, timeout_s, 0.0,
                    0.005 if how == "loop" else 0.0, timeout=240, env=env)
    if how == "exit":
        assert results[laggard][0] == 3, f"the exiting rank's status: {results[laggard]}"
        results = [r for i, r in enumerate(results) if i != laggard]
    assert fake_cases.silent_rank_problems(ok(results), ws, laggard, how, timeout_s) == []


@pytest.mark.parametrize("subgroup", [False, True], ids=["world", "subgroup"])
@pytest.mark.parametrize("device_id", [None, 0], ids=["lazy", "eager"])
def test_destroy_keeps_the_result_of_an_enqueued_all_reduce(device_id, subgroup, tmp_path):
    """all_reduce of 4 MiB at 2 ranks, destroy at once, then read: 3.0 everywhere (it read 1.0
    and 2.0 on an H200 while destroy aborted)."""
    results = spawn(fake_cases.destroy_after_all_reduce, 2, f"gpu:{tmp_path}", device_id, subgroup, 1 << 20,
                    timeout=300)
    for rank, (value, took, _) in enumerate(ok(results)):
        assert value == [3.0], f"rank {rank} read {value} after destroy, not the all_reduce's 3.0"
        assert took < 20, f"rank {rank}: destroy took {took:.1f}s"
