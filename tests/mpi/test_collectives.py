"""The mpi backend under mpirun (real processes, world sizes 1-4): every collective x every
ReduceOp x dtypes x sizes, each checked on every rank against numpy; p2p, async ordering,
object collectives, subgroups with ranks outside them, and bad input, with gloo's cases
(tests/collectives/cases.py) and the MPI-only ones (mpi_cases.py)."""

import pytest

from tests.collectives import cases
from tests.collectives.bad_input_texts import EXPECTED_TEXT

from . import runner


def test_every_planned_case_ran_and_the_job_exited_cleanly(matrix):
    planned = {case_id for case_id, _, _ in runner.matrix_plan(matrix.ranks)} | {"init_warnings"}
    assert matrix.returncode == 0, matrix.output[-4000:]
    for rank, recorded in enumerate(matrix.results):
        assert set(recorded) == planned, f"rank {rank} is missing {sorted(planned - set(recorded))}"


def test_rank_and_size_come_from_mpi(matrix):
    for rank, info in enumerate(matrix.case("world_info")):
        assert info == {"rank": rank, "size": matrix.ranks, "backend": "mpi", "subgroup_backend": "mpi",
                        "initialized": True, "available": True, "world_is_default": True, "mpi_rank": rank,
                        "mpi_size": matrix.ranks, "thread_level": "MPI_THREAD_MULTIPLE"}


def test_rank_and_world_size_arguments_are_ignored_with_torchs_warning(matrix):
    for rank, texts in enumerate(matrix.case("init_warnings")):
        assert texts == [f"For MPI backend, world_size (99) and rank (99) are ignored since they are assigned by "
                         f"the MPI runtime (here rank {rank} of {matrix.ranks})."]


def test_destroy_then_init_again_with_agreeing_arguments_does_not_warn(matrix):
    for rank, outcome in enumerate(matrix.case("reinit")):
        assert outcome == (rank, matrix.ranks, sum(range(matrix.ranks)), [])


@pytest.mark.parametrize("op_name", runner.ALL_REDUCE_OPS)
def test_all_reduce_matches_numpy_and_is_identical_on_every_rank(matrix, op_name):
    per_rank = matrix.case(f"all_reduce/{op_name}")
    wrong = [(rank, dtype, n) for rank, rows in enumerate(per_rank) for dtype, n, ok, _ in rows if not ok]
    assert not wrong, f"{op_name}: results differ from numpy at (rank, dtype, size): {wrong[:10]}"
    digests = [[d for _, _, _, d in rows] for rows in per_rank]
    assert all(d == digests[0] for d in digests), f"{op_name}: ranks hold different results"
    assert len(per_rank[0]) == sum(cases.valid(op_name, d) for d in cases.ALL_DTYPES) * len(runner.SIZES)


@pytest.mark.parametrize("op_name", runner.ALL_REDUCE_OPS)
def test_reduce_to_each_end(matrix, op_name):
    for root in sorted({0, matrix.ranks - 1}):
        per_rank = matrix.case(f"reduce/{op_name}/root{root}")
        wrong = [(rank, dtype, n) for rank, rows in enumerate(per_rank) for dtype, n, ok in rows if not ok]
        assert not wrong, f"reduce {op_name} to rank {root}: wrong at (rank, dtype, size) {wrong[:10]}"
        assert len(per_rank[0]) == sum(cases.valid(op_name, d) for d in runner.REDUCE_DTYPES) * 4


@pytest.mark.parametrize("op_name", runner.ALL_REDUCE_OPS)
def test_reduce_scatter_both_forms(matrix, op_name):
    per_rank = matrix.case(f"reduce_scatter/{op_name}")
    wrong = [(rank, dtype, n, t, lst) for rank, rows in enumerate(per_rank) for dtype, n, t, lst in rows
             if not (t and lst)]
    assert not wrong, f"reduce_scatter {op_name}: (rank, dtype, size, tensor ok, list ok) {wrong[:10]}"
    assert per_rank[0], "no dtype was tried"


def test_broadcast_from_first_and_last(matrix):
    per_rank = matrix.case("broadcast")
    wrong = [row for rows in per_rank for row in rows if row[-1] is not True]
    assert not wrong, f"broadcast wrong at (root, dtype, size, what): {wrong[:10]}"
    assert len(per_rank[0]) == len({0, matrix.ranks - 1}) * 5 * 4


@pytest.mark.parametrize("case_id", ["gather_family/int32/0", "gather_family/float64/1", "gather_family/uint8/1003",
                                     "gather_family/float16/70001", "gather_family/bool/9"])
def test_gather_family(matrix, case_id):
    for rank, results in enumerate(matrix.case(case_id)):
        assert set(results) == {"all_gather", "all_gather_into_tensor", "gather", "scatter"}
        assert cases.wrong(results) == {}, f"rank {rank}: {cases.wrong(results)}"


@pytest.mark.parametrize("case_id", ["all_to_all/int64/1", "all_to_all/float32/4097", "all_to_all/complex64/3"])
def test_all_to_all_with_equal_and_uneven_splits(matrix, case_id):
    for rank, results in enumerate(matrix.case(case_id)):
        assert len(results) == 3 and cases.wrong(results) == {}, f"rank {rank}: {cases.wrong(results)}"


def test_all_to_all_with_a_different_size_per_peer(matrix):
    assert matrix.case("all_to_all_sizes") == [True] * matrix.ranks


def test_barriers(matrix):
    early = cases.left_before_the_last_arrived(matrix.case("barriers"))
    assert early == {}, f"ranks that left a barrier before the last rank arrived (seconds before): {early}"


def test_point_to_point(matrix):
    per_rank = matrix.case("p2p")
    for rank, results in enumerate(per_rank):
        assert all(results.values()), f"rank {rank}: {results}"
    if matrix.ranks > 1:
        assert {"tags", "any_source", "batch"} <= set(per_rank[0])


def test_any_source_recv_in_a_subgroup_returns_the_global_rank_and_sizes_are_checked(matrix):
    ws = matrix.ranks
    per_rank = matrix.case("p2p_mpi")
    if ws == 1:
        return
    at_0 = per_rank[0]
    assert at_0["sender"] == ws - 1 and at_0["data"] == [0.0, 1.0, 2.0, 3.0]
    assert "recv of 4 x float64" in at_0["shorter"] and "got 3 elements" in at_0["shorter"], at_0["shorter"]
    assert "recv" in at_0["longer"] and "failed in MPI" in at_0["longer"], at_0["longer"]
    assert at_0["group_still_works"] and per_rank[ws - 1]["group_still_works"]


def test_isend_progresses_while_the_group_runs_a_collective(matrix):
    assert matrix.case("isend_does_not_wait_for_the_group") == [True] * matrix.ranks


def test_async_operations_run_in_issue_order(matrix):
    ws = matrix.ranks
    for rank, results in enumerate(matrix.case("async_ordering")):
        assert results["value"] == float(ws ** 5), f"rank {rank}: {results}"
        assert results["completed"] and results["future_value_is_array"], results
        assert results["then"] == "chained"
        assert results["sync_after_async"] == ws ** 2
        assert results["broadcast_then_reduce"] == 0.0


def test_async_operations_on_two_groups(matrix):
    ws = matrix.ranks
    assert matrix.case("async_two_groups") == [(True, float(ws ** 3), 2.0)] * ws


def test_every_collective_with_async_op(matrix):
    for rank, results in enumerate(matrix.case("async_every_collective")):
        assert len(results) == 11 and all(results.values()), f"rank {rank}: {results}"


def test_long_double_and_its_complex(matrix):
    for rank, results in enumerate(matrix.case("wide_dtypes")):
        assert len(results) == 5 and all(results.values()), f"rank {rank}: {results}"


def test_object_collectives(matrix):
    for rank, results in enumerate(matrix.case("objects")):
        assert all(results.values()), f"rank {rank}: {results}"


def test_bad_input_gets_glo_os_errors_and_the_group_stays_usable(matrix):
    for rank, errors in enumerate(matrix.case("bad_input")):
        if matrix.ranks == 1:
            errors.pop("send_to_self")
        assert errors.pop("still_works") is True
        for name, text in errors.items():
            assert EXPECTED_TEXT[name] in text, f"rank {rank}, {name}: {text!r}"


def test_bad_input_the_mpi_backend_refuses(matrix):
    for rank, errors in enumerate(matrix.case("bad_input_mpi")):
        assert errors.pop("still_works") is True, f"rank {rank}: {errors}"
        assert "MPI_TAG_UB (2147483647)" in errors.get("tag_above_ub", "MPI_TAG_UB (2147483647)"), (rank, errors)
        assert "needs a store" in errors["gloo_subgroup"] and "backend='mpi'" in errors["gloo_subgroup"], (rank, errors)


def test_cupy_arrays_are_staged_through_host_memory(matrix):
    assert matrix.case("staged") == [[]] * matrix.ranks


def test_subgroups_with_ranks_outside(matrix):
    ws = matrix.ranks
    for rank, results in enumerate(matrix.case("subgroups")):
        for name, members in {"first": [0], "last": [ws - 1], "ends": sorted({0, ws - 1}), "all": list(range(ws)),
                              "evens": list(range(0, ws, 2))}.items():
            r = results[name]
            if rank in members:
                assert r["sum"] == sum(members) and r["group_size"] == len(members) and r["ranks"] == members, r
                assert r["group_rank"] == members.index(rank) and r["global_of_0"] == members[0], r
                assert r["group_of_me"] == members.index(rank) and r["broadcast"] == float(members[-1]), r
            else:
                assert r["is_non_member"] and r["rank"] == -1 and r["size"] == -1, (name, r)
                assert r["collective_returns"] is None and r["warned"], (name, r)
        members = list(range(1, ws)) or [0]
        if rank in members:
            assert results["local_sync"] == (sum(members), [10 * m for m in members], members.index(rank))
        else:
            assert "local_sync" not in results


def test_monitored_barrier_names_the_late_rank(matrix):
    ws = matrix.ranks
    per_rank = matrix.case("monitored_barrier_late_rank")
    if ws == 1:
        return
    assert per_rank[0]["outcome"] == f"Ranks {ws - 1} failed to pass monitoredBarrier in 1000 ms", per_rank[0]
    assert per_rank[0]["elapsed"] < 2.4, per_rank[0]
    assert "rank 0 reported that other ranks did not reach the barrier" in per_rank[ws - 1]["outcome"]
    for r in range(1, ws - 1):
        assert "rank 0 reported" in per_rank[r]["outcome"], per_rank[r]
    assert all(r["after"] == ws for r in per_rank)
