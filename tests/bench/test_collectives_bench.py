"""``distlib bench collectives``: the command runs real ranks, its JSON has a row per op and
size whose busbw follows from size and time by nccl-tests' factors, results are checked (a
wrong result reports no bandwidth), bad options fail with one clear line, and --plot either
writes a PNG or says matplotlib is missing. Timings are reported, never asserted."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys

import numpy as np
import pytest

from distlib.bench import collectives as bench

ALL_OPS = list(bench.OPS)
TINY = ["--min-bytes", "4", "--max-bytes", "4K", "--step-factor", "16", "--iters", "3", "--warmup", "1",
        "--rounds", "1"]


def run_bench(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """The command, in its own process (it forks its ranks from a clean parent)."""
    return subprocess.run([sys.executable, "-m", "distlib.cli", "bench", "collectives", *args],
                          capture_output=True, text=True, timeout=timeout)


def expected_factor(op: str, n: int) -> float:
    return {"all_reduce": 2 * (n - 1) / n, "broadcast": 1.0, "reduce": 1.0}.get(op, (n - 1) / n)


@pytest.mark.parametrize("nproc", [2, 3])
def test_json_has_every_op_with_busbw_from_size_and_time(nproc):
    result = run_bench("--nproc", str(nproc), "--no-torch", "--ops", ",".join(ALL_OPS), *TINY,
                       "--init-sizes", "2", "--json", "-", "--quiet")
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["benchmark"] == "distlib bench collectives" and doc["implementations"] == ["distlib"]
    assert doc["nproc"] == nproc and doc["failures"] == []
    entries = doc["collectives"]
    assert {e["op"] for e in entries} == set(ALL_OPS)
    for e in entries:
        d = e["distlib"]
        assert e["ranks"] == nproc and e["dtype"] == "float32" and "torch" not in e
        assert e["busbw_factor"] == pytest.approx(expected_factor(e["op"], nproc))
        assert e["bytes"] == e["count"] * 4
        if e["op"] in bench.CHUNKED:
            assert e["count"] % nproc == 0 and e["count"] >= nproc
        assert d["validated"] is True and d["error"] is None
        assert d["time_us"] > 0 and len(d["rounds_us"]) == 1 and len(d["per_rank_us"][0]) == nproc
        # time = max over ranks of the mean per op
        assert d["time_us"] == pytest.approx(max(d["per_rank_us"][0]), abs=1e-3)  # per-rank figures: 3 decimals
        algbw = e["bytes"] / (d["time_us"] * 1e-6) / 1e9
        assert d["algbw_gbs"] == pytest.approx(algbw, rel=1e-6)
        assert d["busbw_gbs"] == pytest.approx(algbw * expected_factor(e["op"], nproc), rel=1e-6)
    sizes = sorted(e["bytes"] for e in entries if e["op"] == "all_reduce")
    assert sizes == [4, 64, 1024]
    init = [r for r in doc["rows"] if r["section"] == "init"]
    assert len(init) == 1 and init[0]["distlib"]["median"] > 0
    # without torch, the relative targets cannot be judged; the 64 MiB one is not in this run
    assert {t["result"] for t in doc["targets"]} == {"n/a"}
    # the table went to stderr (stdout holds the JSON)
    assert "size (B)" in result.stderr and "busbw (GB/s)" in result.stderr


def test_table_reads_like_nccl_tests(tmp_path):
    out = tmp_path / "coll.json"
    result = run_bench("--nproc", "2", "--no-torch", "--ops", "all_reduce,broadcast", *TINY, "--init-sizes", "none",
                       "--json", str(out))
    assert result.returncode == 0, result.stderr
    text = result.stdout
    assert "torch not measured: --no-torch" in text
    for title in ("all_reduce (sum), float32, 2 ranks", "broadcast, float32, 2 ranks"):
        assert title in text
    header = [line for line in text.splitlines() if line.startswith("size (B)")]
    assert len(header) == 2
    for word in ("count", "type", "time (us)", "algbw (GB/s)", "busbw (GB/s)", "check"):
        assert word in header[0]
    assert "all_reduce 4 B latency, 2 ranks" in text and "n/a (no torch)" in text
    assert json.loads(out.read_text())["config"]["init_sizes"] == []


def test_tcp_transport_turns_shared_memory_off():
    """--transport tcp reaches the ranks as DISTLIB_SHM=0; the default lets distlib's large
    all_reduce take shared memory (both reported in the JSON environment)."""
    seen = {}
    for transport in ("tcp", "shm"):
        result = run_bench("--nproc", "2", "--no-torch", "--ops", "all_reduce", "--min-bytes", "256K",
                           "--max-bytes", "256K", "--iters", "2", "--warmup", "1", "--rounds", "1",
                           "--init-sizes", "none", "--transport", transport, "--json", "-", "--quiet")
        assert result.returncode == 0, result.stderr
        doc = json.loads(result.stdout)
        seen[transport] = doc["environment"]["distlib_shm_all_reduce"]
        assert doc["environment"]["transport"] == transport
    assert seen == {"tcp": "off", "shm": "on"}


def exit_code(args) -> int:
    """main's exit status, whether it returns it or argparse exits with it."""
    try:
        return bench.main(args)
    except SystemExit as exc:
        return exc.code


@pytest.mark.parametrize("args, words", [
    (["--nproc", "0"], "--nproc must be at least 2"),
    (["--nproc", "1"], "--nproc must be at least 2"),
    (["--ops", "all_reduce,allgatherv"], "unknown op 'allgatherv'"),
    (["--min-bytes", "1M", "--max-bytes", "1K"], "is larger than --max-bytes"),
    (["--min-bytes", "12Q"], "expected a size like"),
    (["--step-factor", "1"], "--step-factor must be at least 2"),
    (["--iters", "0"], "--iters and --rounds must be >= 1"),
    (["--init-sizes", "8,x"], "comma-separated world sizes"),
    (["--dtype", "complex64"], "invalid choice"),
])
def test_bad_options_fail_with_a_clear_error(args, words, capsys):
    assert exit_code(args) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err


def test_plot_writes_a_png_or_says_matplotlib_is_missing(tmp_path):
    png = tmp_path / "busbw.png"
    result = run_bench("--nproc", "2", "--no-torch", "--ops", "all_reduce", *TINY, "--init-sizes", "none",
                       "--plot", str(png), "--quiet")
    if importlib.util.find_spec("matplotlib") is None:
        assert result.returncode == 2
        assert result.stdout == ""  # refused before anything ran
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and "--plot needs matplotlib" in lines[0], result.stderr
        assert not png.exists()
    else:
        assert result.returncode == 0, result.stderr
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_into_a_missing_directory_is_refused(tmp_path):
    if importlib.util.find_spec("matplotlib") is None:
        pytest.skip("matplotlib not importable: --plot is refused before the directory is looked at")
    result = run_bench("--nproc", "2", "--no-torch", "--plot", str(tmp_path / "no" / "such.png"))
    assert result.returncode == 2 and "does not exist" in result.stderr


def test_a_wrong_result_reports_no_bandwidth(monkeypatch, capsys):
    """A broken all_reduce (one element off on rank 1) is caught by the check: the row says
    WRONG, has no figures, and the command fails. The ranks are forked from this process, so
    they inherit the broken function."""
    import distlib

    real = distlib.all_reduce

    def broken(tensor, *args, **kwargs):
        work = real(tensor, *args, **kwargs)
        if distlib.get_rank() == 1:
            tensor[-1] += 1
        return work

    monkeypatch.setattr(distlib, "all_reduce", broken)
    code = bench.main(["--nproc", "2", "--no-torch", "--ops", "all_reduce,broadcast", *TINY,
                       "--init-sizes", "none", "--json", "-", "--quiet"])
    captured = capsys.readouterr()
    assert code == 1
    doc = json.loads(captured.out)
    for e in doc["collectives"]:
        d = e["distlib"]
        if e["op"] == "all_reduce":
            assert d["validated"] is False and d["error"].startswith("WRONG: rank 1")
            assert d["time_us"] is None and d["busbw_gbs"] is None and d["rounds_us"] == []
        else:
            assert d["validated"] is True and d["busbw_gbs"] > 0
    assert "distlib WRONG" in captured.err
    assert any("wrong result" in f for f in doc["failures"])


# -- the helpers, in this process ------------------------------------------------------------------


@pytest.mark.parametrize("op, n, factor", [
    ("all_reduce", 2, 1.0), ("all_reduce", 4, 1.5), ("all_reduce", 8, 1.75),
    ("all_gather_into_tensor", 4, 0.75), ("reduce_scatter_tensor", 2, 0.5), ("all_to_all_single", 8, 0.875),
    ("broadcast", 4, 1.0), ("reduce", 8, 1.0),
])
def test_busbw_factors_are_nccl_tests(op, n, factor):
    assert bench.busbw_factor(op, n) == pytest.approx(factor)


def test_sizes_round_to_whole_elements_and_chunks():
    assert bench.op_size("all_reduce", 4, 4, 2) == (4, 1)
    assert bench.op_size("all_reduce", 2, 4, 2) == (4, 1)  # at least one element
    assert bench.op_size("all_gather_into_tensor", 4, 4, 2) == (8, 2)  # one element per rank at least
    assert bench.op_size("reduce_scatter_tensor", 1024, 4, 3) == (1020, 255)
    assert bench.op_size("all_to_all_single", 64 << 20, 4, 4) == (64 << 20, 16 << 20)
    assert bench.size_sweep(4, 64 << 20, 4)[-1] == 64 << 20 and len(bench.size_sweep(4, 64 << 20, 4)) == 13
    assert bench.size_sweep(5, 4, 2) == []
    assert [bench.parse_bytes(t) for t in ("4", "4B", "64K", "64KiB", "64M", "1g")] == \
        [4, 4, 65536, 65536, 64 << 20, 1 << 30]
    assert math.isnan(bench.algbw_gbs(100, 0.0)) and bench.algbw_gbs(10**9, 1.0) == 1.0


def _emulate(op: str, cases):
    """What a correct op leaves in every rank's buffers (numpy, in this process)."""
    n = len(cases)
    if op in ("all_reduce", "reduce"):
        total = cases[0].buf.copy()
        for c in cases[1:]:
            total = np.add(total, c.buf, dtype=total.dtype)
        for r, c in enumerate(cases):
            if op == "all_reduce" or r == 0:
                c.buf[:] = total
    elif op == "broadcast":
        for c in cases[1:]:
            c.buf[:] = cases[0].buf
    elif op == "all_gather_into_tensor":
        gathered = np.concatenate([c.inp for c in cases])
        for c in cases:
            c.out[:] = gathered
    elif op == "reduce_scatter_tensor":
        total = cases[0].inp.copy()
        for c in cases[1:]:
            total = np.add(total, c.inp, dtype=total.dtype)
        k = cases[0].chunk
        for r, c in enumerate(cases):
            c.out[:] = total[r * k:(r + 1) * k]
    else:
        k = cases[0].chunk
        for r, c in enumerate(cases):
            c.out[:] = np.concatenate([cases[s].inp[r * k:(r + 1) * k] for s in range(n)])


@pytest.mark.parametrize("dtype", ["float32", "float16", "int8", "uint8", "int64"])
@pytest.mark.parametrize("op", ALL_OPS)
def test_validation_accepts_right_results_and_catches_misplaced_chunks(op, dtype):
    n, count = 3, 3 * 600  # chunks longer than the pattern period
    cases = [bench._Case(op, count, dtype, r, n) for r in range(n)]
    for c in cases:
        c.fill()
    _emulate(op, cases)
    assert [c.check() for c in cases] == [None] * n
    # the same data with its first two pieces swapped (chunks of a gathered or exchanged
    # output, the halves of any other buffer) is caught
    victim = cases[0]
    arr = victim.out if hasattr(victim, "out") else victim.buf
    k = victim.chunk if op in ("all_gather_into_tensor", "all_to_all_single") else len(arr) // 2
    arr[:k], arr[k:2 * k] = arr[k:2 * k].copy(), arr[:k].copy()
    problem = victim.check()
    assert problem is not None and "elements wrong" in problem


# -- with torch ------------------------------------------------------------------------------------


@pytest.mark.interop
def test_against_torch_gloo(tmp_path):
    pytest.importorskip("torch", reason="torch not importable: run `make test-interop`")
    out = tmp_path / "coll.json"
    result = run_bench("--nproc", "2", "--ops", "all_reduce,reduce_scatter,all_to_all", *TINY,
                       "--init-sizes", "2", "--json", str(out), "--quiet", timeout=300)
    assert result.returncode == 0, result.stderr
    doc = json.loads(out.read_text())
    assert doc["implementations"] == ["distlib", "torch"] and doc["environment"]["torch"].startswith("2.")
    for e in doc["collectives"]:
        for impl in ("distlib", "torch"):
            assert e[impl]["validated"] is True and e[impl]["time_us"] > 0, e
        assert e["torch"]["busbw_gbs"] == pytest.approx(
            e["bytes"] / (e["torch"]["time_us"] * 1e-6) / 1e9 * e["busbw_factor"], rel=1e-6)
        # the ratio is distlib busbw / torch busbw (one round: no median in between)
        assert e["ratio"] == pytest.approx(e["distlib"]["busbw_gbs"] / e["torch"]["busbw_gbs"], rel=1e-6)
    latency = [t for t in doc["targets"] if t["label"].startswith("all_reduce 4 B latency")][0]
    assert latency["result"] in ("PASS", "MISS")
    assert "torch (us)" in result.stdout and "ratio" in result.stdout
