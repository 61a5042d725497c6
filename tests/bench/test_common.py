"""distlib.bench.common: the helpers every benchmark shares (tables, rows and targets,
statistics, child processes, JSON)."""

from __future__ import annotations

import json
import math
import os

import pytest

from distlib.bench import common
from distlib.bench.common import BenchError, Child, ChildError, Row, Table, Target


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
    assert common.fmt_num(value) == text


@pytest.mark.parametrize("seconds, text", [(45e-6, "45.0 us"), (0.0341, "34.1 ms"), (25.1, "25.1 s")])
def test_fmt_seconds_picks_a_unit(seconds, text):
    assert common.fmt_seconds(seconds) == text


def test_quantile_median_spread_histogram():
    assert common.median([3, 1, 2]) == 2
    assert common.median([1, 2, 3, 4]) == 2.5
    assert math.isnan(common.median([]))
    assert common.quantile([0, 10], 0.9) == 9
    assert common.spread([100, 125]) == pytest.approx(0.25)
    assert common.spread([5]) == 0.0
    hist = common.histogram([0.001, 0.05, 0.05, 5.0], ((0.01, "<10ms"), (0.1, "10-100ms"), (math.inf, ">=100ms")))
    assert hist == {"<10ms": 1, "10-100ms": 2, ">=100ms": 1}


def test_row_speedup_is_higher_is_better_whatever_the_unit():
    rate = Row("s", "get", "ops/s", True, Target(">= 2x", min_speedup=2.0))
    for v in (30_000, 40_000, 50_000):
        rate.add("distlib", v)
    rate.add("torch", 10_000)
    rate.add("torch", 20_000)
    assert rate.median("distlib") == 40_000 and rate.median("torch") == 15_000
    assert rate.speedup() == pytest.approx(40_000 / 15_000)
    assert rate.result() == common.PASS

    time_row = Row("s", "barrier", "s", False, Target("faster", min_speedup=1.0))
    time_row.add("distlib", 0.050)
    time_row.add("torch", 0.040)
    assert time_row.speedup() == pytest.approx(0.8)  # torch / distlib: distlib is slower
    assert time_row.result() == common.MISS


def test_row_results_without_a_reference_and_with_absolute_targets():
    relative = Row("s", "add", "ops/s", True, Target(">= 2x", min_speedup=2.0))
    relative.add("distlib", 1.0)
    assert relative.result() == common.NOT_MEASURED  # no torch figures: not measurable
    bound = Row("s", "storm", "s", False, Target("within 1 s", max_value=1.0))
    bound.add("distlib", 0.2)
    assert bound.result() == common.PASS
    bound.fail("distlib", "3 clients failed")
    assert bound.result() == common.MISS
    doc = bound.to_json(["distlib"])
    assert doc["distlib"]["error"] == "3 clients failed" and doc["result"] == common.MISS
    assert Row("s", "untargeted", "ops/s", True).result() == ""


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
    paired = common.paired_ratio(torch, distlib)
    assert paired.pairs == 30
    assert paired.median == pytest.approx(1.1)
    assert paired.low == pytest.approx(1.1) and paired.high == pytest.approx(1.1)


def test_paired_ratio_interval_covers_noise_and_is_reproducible():
    torch = [1.00, 1.10, 0.95, 1.20, 0.90, 1.05, 1.15, 0.85, 1.00, 1.10]
    distlib = [1.0] * 10
    a = common.paired_ratio(torch, distlib)
    assert a.low < a.median < a.high
    assert a.low >= 0.85 and a.high <= 1.20
    assert common.paired_ratio(torch, distlib) == a  # fixed seed: the same numbers give the same interval
    assert a.to_json() == {"median": a.median, "ci95": [a.low, a.high], "pairs": 10}


def test_paired_ratio_of_nothing_is_nan_with_no_pairs():
    empty = common.paired_ratio([], [])
    assert empty.pairs == 0 and math.isnan(empty.median)
    assert empty.to_json() == {"median": None, "ci95": [None, None], "pairs": 0}
    assert common.paired_ratio([1.0, 0.0], [0.0, 1.0]).pairs == 0  # a zero time is no measurement


def test_interleaved_order():
    assert common.interleaved(2, ["a", "b"]) == [(0, "a"), (0, "b"), (1, "a"), (1, "b")]


def test_write_json_to_a_file_and_to_stdout(tmp_path, capsys):
    path = tmp_path / "out.json"
    common.write_json(str(path), {"x": [1, 2]})
    assert json.loads(path.read_text()) == {"x": [1, 2]}
    common.write_json("-", {"y": 1})
    assert json.loads(capsys.readouterr().out) == {"y": 1}


def test_timed_loop_counts_and_times_calls():
    calls = []
    result = common.timed_loop(calls.append, 0.01, batch=8)
    assert result.ops == len(calls) and result.ops % 8 == 0 and result.ops >= 8
    assert len(result.latencies) == result.ops and result.rate > 0


def test_environment_names_the_machine():
    env = common.environment({"extra": 1})
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
    assert common.run_child(_echo_now, 5, timeout=30) == 10


def _echo_now(conn, x):
    return x * 2
