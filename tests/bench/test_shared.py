"""What every benchmark shares (distlib_bench: children.py, timing.py, results.py,
tables.py): tables, rows and targets, statistics, child processes, the targets file."""

from __future__ import annotations

import json
import math
import os

import pytest

from distlib_bench import results, tables, timing
from distlib_bench.children import BenchError, Child, ChildError, run_child
from distlib_bench.results import Row, Target
from distlib_bench.tables import Table


def test_table_aligns_text_left_and_numbers_right():
    table = Table(["load", "ops/s", "note"], "lrl")
    table.add("get", "41,766", "fast")
    table.separator()
    table.add("multi_get (8 keys)", "9", "")
    lines = table.render().splitlines()
    assert lines[0].startswith("load") and lines[1].startswith("---")
    widths = {len(line) for line in lines if not line.endswith(" ")}
    assert lines[2].index("41,766") + len("41,766") == lines[4].index("9") + 1  # right edges line up
    assert lines[3].startswith("----")  # the separator
    assert all(not line.endswith(" ") for line in lines) and widths


def test_table_rejects_a_wrong_number_of_cells():
    table = Table(["a", "b"])
    with pytest.raises(ValueError):
        table.add("only one")
    with pytest.raises(ValueError):
        Table(["a", "b"], "l")


@pytest.mark.parametrize("value, text", [
    (123456.7, "123,457"), (999.4, "999"), (12.345, "12.3"), (1.2345, "1.23"), (0.01234, "0.0123"),
    (float("nan"), "-"), (None, "-"),
])
def test_fmt_num(value, text):
    assert tables.fmt_num(value) == text


@pytest.mark.parametrize("seconds, text", [(45e-6, "45.0 us"), (0.0341, "34.1 ms"), (25.1, "25.1 s")])
def test_fmt_seconds_picks_a_unit(seconds, text):
    assert tables.fmt_seconds(seconds) == text


def test_quantile_median_spread_histogram():
    assert timing.median([3, 1, 2]) == 2
    assert timing.median([1, 2, 3, 4]) == 2.5
    assert math.isnan(timing.median([]))
    assert timing.quantile([0, 10], 0.9) == 9
    assert timing.spread([100, 125]) == pytest.approx(0.25)
    assert timing.spread([5]) == 0.0
    hist = timing.histogram([0.001, 0.05, 0.05, 5.0], ((0.01, "<10ms"), (0.1, "10-100ms"), (math.inf, ">=100ms")))
    assert hist == {"<10ms": 1, "10-100ms": 2, ">=100ms": 1}


def test_row_speedup_is_higher_is_better_whatever_the_unit():
    rate = Row("s", "get", "ops/s", True, Target(">= 2x", min_speedup=2.0))
    for v in (30_000, 40_000, 50_000):
        rate.add("distlib", v)
    rate.add("torch", 10_000)
    rate.add("torch", 20_000)
    assert rate.median("distlib") == 40_000 and rate.median("torch") == 15_000
    assert rate.speedup() == pytest.approx(40_000 / 15_000)
    assert rate.result() == results.PASS

    time_row = Row("s", "barrier", "s", False, Target("faster", min_speedup=1.0))
    time_row.add("distlib", 0.050)
    time_row.add("torch", 0.040)
    assert time_row.speedup() == pytest.approx(0.8)  # torch / distlib: distlib is slower
    assert time_row.result() == results.MISS


def test_row_results_without_a_reference_and_with_absolute_targets():
    relative = Row("s", "add", "ops/s", True, Target(">= 2x", min_speedup=2.0))
    relative.add("distlib", 1.0)
    assert relative.result() == results.NOT_MEASURED  # no torch figures: not measurable
    bound = Row("s", "storm", "s", False, Target("within 1 s", max_value=1.0))
    bound.add("distlib", 0.2)
    assert bound.result() == results.PASS
    bound.fail("distlib", "3 clients failed")
    assert bound.result() == results.MISS
    doc = bound.to_json(["distlib"])
    assert doc["distlib"]["error"] == "3 clients failed" and doc["result"] == results.MISS
    assert Row("s", "untargeted", "ops/s", True).result() == ""


def test_a_target_on_the_excess_over_the_reference():
    """--backend mpi's latency target: distlib's time at most 15 us above raw mpi4py's."""
    row = Row("all_reduce", "4 B", "s", False, Target("<= raw mpi4py + 15 us", max_excess=15e-6))
    row.add("distlib", 20e-6)
    assert row.result("distlib", "mpi4py") == results.NOT_MEASURED and math.isnan(row.excess("distlib", "mpi4py"))
    row.add("mpi4py", 6e-6)
    assert row.excess("distlib", "mpi4py") == pytest.approx(14e-6) and row.result("distlib", "mpi4py") == results.PASS
    row.add("distlib", 30e-6)
    row.add("distlib", 40e-6)  # median 30 us: 24 us above
    assert row.result("distlib", "mpi4py") == results.MISS
    assert row.to_json(["distlib", "mpi4py"], "mpi4py")["target"] == {"text": "<= raw mpi4py + 15 us",
                                                                      "max_excess": 15e-6}
    row.fail("mpi4py", "MPI job did not start")
    assert math.isnan(row.excess("distlib", "mpi4py")) and row.result("distlib", "mpi4py") == results.NOT_MEASURED


def test_row_json_has_rounds_medians_and_nulls_for_nan():
    row = Row("single client", "get", "ops/s", True, Target(">= 2x", min_speedup=2.0), note="n")
    row.add("distlib", 10.0, p50_us=3.0)
    row.add("distlib", 30.0, p50_us=2.0)
    doc = row.to_json(["distlib", "torch"])
    json.dumps(doc)  # serialisable
    assert doc["distlib"]["median"] == 20.0 and doc["distlib"]["rounds"] == [10.0, 30.0]
    assert doc["distlib"]["details"] == [{"p50_us": 3.0}, {"p50_us": 2.0}]
    assert doc["torch"]["median"] is None and doc["speedup"] is None
    assert doc["target"] == {"text": ">= 2x", "min_speedup": 2.0} and doc["note"] == "n"


def test_paired_ratio_cancels_a_drift_both_sides_saw():
    # the machine's speed swings 3x from pair to pair; within each pair torch takes 10% longer
    drift = [1.0, 3.0, 1.2, 2.5, 0.9, 2.8, 1.1, 3.1, 1.0, 2.9] * 3
    distlib = [0.05 * d for d in drift]
    torch = [0.055 * d for d in drift]
    paired = timing.paired_ratio(torch, distlib)
    assert paired.pairs == 30
    assert paired.median == pytest.approx(1.1)
    assert paired.low == pytest.approx(1.1) and paired.high == pytest.approx(1.1)


def test_paired_ratio_interval_covers_noise_and_is_reproducible():
    torch = [1.00, 1.10, 0.95, 1.20, 0.90, 1.05, 1.15, 0.85, 1.00, 1.10]
    distlib = [1.0] * 10
    a = timing.paired_ratio(torch, distlib)
    assert a.low < a.median < a.high
    assert a.low >= 0.85 and a.high <= 1.20
    assert timing.paired_ratio(torch, distlib) == a  # fixed seed: the same numbers give the same interval
    assert a.to_json() == {"median": a.median, "ci95": [a.low, a.high], "pairs": 10}


def test_paired_ratio_of_nothing_is_nan_with_no_pairs():
    empty = timing.paired_ratio([], [])
    assert empty.pairs == 0 and math.isnan(empty.median)
    assert empty.to_json() == {"median": None, "ci95": [None, None], "pairs": 0}
    assert timing.paired_ratio([1.0, 0.0], [0.0, 1.0]).pairs == 0  # a zero time is no measurement


def test_interleaved_order():
    assert timing.interleaved(2, ["a", "b"]) == [(0, "a"), (0, "b"), (1, "a"), (1, "b")]


def test_timed_loop_counts_and_times_calls():
    calls = []
    result = timing.timed_loop(calls.append, 0.01, batch=8)
    assert result.ops == len(calls) and result.ops % 8 == 0 and result.ops >= 8
    assert len(result.latencies) == result.ops and result.rate > 0


def test_environment_names_the_machine():
    env = tables.environment({"extra": 1})
    assert env["nproc"] == os.cpu_count() and env["python"] and env["extra"] == 1
    assert "distlib" in env and "torch" in env


# -- child processes ------------------------------------------------------------------------------


def _echo(conn, factor):
    conn.send(("ready", os.getpid()))
    msg = conn.recv()
    return msg * factor


def _fails(conn):
    raise ValueError("boom in the child")


def _hangs(conn):
    conn.recv()  # waits for the parent, which never writes


def test_child_messages_and_result():
    with Child(_echo, 3, name="echo") as child:
        pid = child.recv(30)
        assert pid == child.pid != os.getpid()
        child.send(7)
        assert child.result(30) == 21


def test_child_error_carries_the_traceback():
    child = Child(_fails, name="failing")
    with pytest.raises(ChildError, match="(?s)failing.*ValueError: boom in the child"):
        child.result(30)
    child.stop()


def test_child_that_hangs_times_out_and_is_stopped():
    child = Child(_hangs, name="hanging")
    with pytest.raises(BenchError, match="sent nothing within"):
        child.recv(0.2)
    child.stop(timeout=5)
    assert not child.proc.is_alive()


def test_run_child_returns_the_result():
    assert run_child(_echo_now, 5, timeout=30) == 10


def _echo_now(conn, x):
    return x * 2


# -- the targets, as data ---------------------------------------------------------------------


def test_the_shipped_targets_load_for_both_benchmarks():
    store = results.load_targets("store")
    assert store["single_client"]["get"] == Target(">= 2x torch", min_speedup=2.0)
    assert store["connect_storm"]["applies"] == {"min_clients": 256}
    assert store["connect_storm"]["target"].max_value == 1.0
    coll = results.load_targets("collectives")
    assert coll["all_reduce_busbw"]["shm"].min_speedup == 2.0 and coll["init_absolute"]["applies"] == {"ranks": 32}
    mpi = results.load_targets("collectives_mpi")
    assert mpi["all_reduce_busbw"]["target"].min_speedup == 0.95
    assert mpi["all_reduce_busbw"]["applies"] == {"bytes": 64 << 20, "ranks": [2, 4], "dtype": "float32"}
    assert mpi["all_reduce_latency"]["target"].max_excess == 15e-6


def test_targets_come_from_the_file(tmp_path):
    path = tmp_path / "targets.json"
    path.write_text(json.dumps({"store": {"barrier": {"text": "at most 5 ms", "max_value": 0.005},
                                          "concurrent_clients": {"applies": {"clients": 8},
                                                                 "target": {"text": ">= 3x", "min_speedup": 3}}}}))
    loaded = results.load_targets("store", path)
    assert loaded["barrier"] == Target("at most 5 ms", max_value=0.005)
    assert loaded["concurrent_clients"] == {"applies": {"clients": 8}, "target": Target(">= 3x", min_speedup=3.0)}


@pytest.mark.parametrize("entry, words", [
    ({"text": "x"}, "one number of min_speedup, max_value, min_value"),
    ({"text": "x", "min_speedup": 1, "max_value": 2}, "one number of"),
    ({"text": "x", "min_speedup": "2"}, "one number of"),
    ({"text": "x", "min_speedup": 2, "typo": 1}, "one number of"),
    (3, "expected a target or a mapping"),
])
def test_a_malformed_target_names_the_file_and_the_entry(tmp_path, entry, words):
    path = tmp_path / "targets.json"
    path.write_text(json.dumps({"store": {"barrier": entry}}))
    with pytest.raises(BenchError, match=rf"{path}: store\.barrier: .*{words}"):
        results.load_targets("store", path)


def test_a_missing_or_broken_targets_file_is_a_clear_error(tmp_path):
    with pytest.raises(BenchError, match="cannot read the benchmark targets"):
        results.load_targets("store", tmp_path / "none.json")
    (tmp_path / "t.json").write_text("{")
    with pytest.raises(BenchError, match="cannot read the benchmark targets"):
        results.load_targets("store", tmp_path / "t.json")
    (tmp_path / "t.json").write_text("{}")
    with pytest.raises(BenchError, match="has no targets for 'store'"):
        results.load_targets("store", tmp_path / "t.json")
