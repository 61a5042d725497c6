"""``distlib bench collectives``: the command runs real ranks, its JSON has a row per op and
size whose busbw follows from size and time by nccl-tests' factors, results are checked (a
wrong result reports no bandwidth), bad options fail with one clear line, and --plot either
writes a PNG or says matplotlib is missing. Timings are reported, never asserted."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from distlib_bench import collectives as bench
from distlib_bench import collectives_cli
from distlib_bench.cases import CHUNKED, Case
from distlib_bench.children import BenchError
from distlib_bench.collectives_ops import OPS, algbw_gbs, busbw_factor, op_size, size_sweep

ALL_OPS = list(OPS)
SIZES = ["--min-bytes", "4", "--max-bytes", "4K", "--step-factor", "16", "--iters", "3", "--warmup", "1",
         "--rounds", "1"]
#: The gloo tests measure distlib's gloo alone (the raw mpi4py floor has tests of its own, below).
TINY = SIZES + ["--no-mpi4py"]


def run_bench(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """The command, in its own process (it forks its ranks from a clean parent)."""
    return subprocess.run([sys.executable, "-m", "distlib_bench", "collectives", *args],
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
        if e["op"] in CHUNKED:
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
        return collectives_cli.main(args)
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
    (["--backend", "nccl"], "--backend nccl runs on GPUs: add --device cuda"),
    (["--no-gloo"], "--no-gloo leaves distlib's gloo out of a --backend mpi run"),
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
    code = collectives_cli.main(["--nproc", "2", "--no-torch", "--ops", "all_reduce,broadcast", *TINY,
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
    assert busbw_factor(op, n) == pytest.approx(factor)


def test_sizes_round_to_whole_elements_and_chunks():
    assert op_size("all_reduce", 4, 4, 2) == (4, 1)
    assert op_size("all_reduce", 2, 4, 2) == (4, 1)  # at least one element
    assert op_size("all_gather_into_tensor", 4, 4, 2) == (8, 2)  # one element per rank at least
    assert op_size("reduce_scatter_tensor", 1024, 4, 3) == (1020, 255)
    assert op_size("all_to_all_single", 64 << 20, 4, 4) == (64 << 20, 16 << 20)
    assert size_sweep(4, 64 << 20, 4)[-1] == 64 << 20 and len(size_sweep(4, 64 << 20, 4)) == 13
    assert size_sweep(5, 4, 2) == []
    assert [bench.parse_bytes(t) for t in ("4", "4B", "64K", "64KiB", "64M", "1g")] == \
        [4, 4, 65536, 65536, 64 << 20, 1 << 30]
    assert math.isnan(algbw_gbs(100, 0.0)) and algbw_gbs(10**9, 1.0) == 1.0


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
    cases = [Case(op, count, dtype, r, n) for r in range(n)]
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



# -- MPI: raw mpi4py as the floor, distlib's mpi backend under mpirun --------------------------------


def need_mpi() -> None:
    """Skip without mpi4py and mpirun; under DISTLIB_REQUIRE_MPI=1 (CI) fail instead."""
    from tests.support import settings
    from distlib_bench import mpi_group

    missing = mpi_group.why_not_available()
    if missing:
        if settings.require_mpi():
            pytest.fail(f"DISTLIB_REQUIRE_MPI is set but the MPI bench cannot run: {missing}")
        pytest.skip(f"no MPI: {missing}")


def check_figures(entry: dict, impl: str, nproc: int) -> None:
    """An implementation's figures of one row: validated, timed on every rank, busbw from size and time."""
    d = entry[impl]
    assert d["validated"] is True and d["error"] is None, (impl, entry)
    assert d["time_us"] > 0 and len(d["per_rank_us"][0]) == nproc
    assert d["time_us"] == pytest.approx(max(d["per_rank_us"][0]), abs=1e-3)
    assert d["busbw_gbs"] == pytest.approx(entry["bytes"] / (d["time_us"] * 1e-6) / 1e9 * entry["busbw_factor"],
                                           rel=1e-6)


def test_the_gloo_run_shows_raw_mpi4py_as_the_floor():
    """The default run measures raw mpi4py too (one MPI job under mpirun, the same sizes and
    rounds), in its own columns; the ratio stays distlib/torch (none without torch)."""
    need_mpi()
    result = run_bench("--nproc", "2", "--no-torch", "--ops", "all_reduce,all_to_all", *SIZES, "--init-sizes",
                       "none", "--json", "-")
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["backend"] == "gloo" and doc["implementations"] == ["distlib", "mpi4py"]
    assert doc["reference"] == "torch" and doc["environment"]["mpi_library"].startswith("Open MPI")
    for e in doc["collectives"]:
        for impl in ("distlib", "mpi4py"):
            check_figures(e, impl, 2)
        assert e["ratio"] is None and "overhead_us" not in e
    header = next(line for line in result.stderr.splitlines() if line.startswith("size (B)"))
    assert "mpi4py (us)" in header and "mpi4py busbw" in header and "ratio" not in header
    assert "raw mpi4py" in result.stderr and "(torch not measured: --no-torch)" in result.stderr


@pytest.mark.parametrize("nproc", [2, 3])
def test_backend_mpi_times_distlib_and_raw_mpi4py_on_the_same_ranks(nproc):
    """--backend mpi starts its ranks under mpirun itself; every op is validated and timed for
    distlib's mpi backend and for raw mpi4py; the ratio is mpi4py's time over distlib's and the
    overhead their difference; the targets are against mpi4py."""
    need_mpi()
    result = run_bench("--backend", "mpi", "--nproc", str(nproc), "--no-gloo", "--ops", ",".join(ALL_OPS), *SIZES,
                       "--json", "-", timeout=300)
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["backend"] == "mpi" and doc["implementations"] == ["distlib", "mpi4py"]
    assert doc["reference"] == "mpi4py" and doc["failures"] == []
    assert {e["op"] for e in doc["collectives"]} == set(ALL_OPS)
    for e in doc["collectives"]:
        for impl in ("distlib", "mpi4py"):
            check_figures(e, impl, nproc)
        assert e["ratio"] == pytest.approx(e["mpi4py"]["time_us"] / e["distlib"]["time_us"], rel=1e-6)
        assert e["overhead_us"] == pytest.approx(e["distlib"]["time_us"] - e["mpi4py"]["time_us"], abs=1e-6)
    assert [r for r in doc["rows"] if r["section"] == "init"] == []  # mpirun set the ranks up
    targets = {t["label"]: t for t in doc["targets"]}
    latency = targets[f"all_reduce 4 B latency, {nproc} ranks"]
    assert latency["target"] == {"text": "<= raw mpi4py + 15 us", "max_excess": 15e-6}
    assert latency["result"] in ("PASS", "MISS")  # measured: timings are reported, never asserted
    if nproc == 2:
        busbw = targets["all_reduce float32 64 MiB busbw, 2 ranks"]
        assert busbw["result"] == "n/a" and "not in this run" in busbw["note"]
    text = result.stderr
    assert "(mpi backend) vs raw mpi4py" in text and "overhead (us)" in text and "mpi4py (us)" in text
    assert "(torch not measured: --no-gloo)" in text


def test_backend_mpi_beside_distlibs_gloo():
    need_mpi()
    result = run_bench("--backend", "mpi", "--nproc", "2", "--no-torch", "--ops", "all_reduce", *SIZES,
                       "--json", "-", "--quiet")
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["implementations"] == ["distlib", "mpi4py", "distlib-gloo"]
    for e in doc["collectives"]:
        for impl in doc["implementations"]:
            check_figures(e, impl, 2)
    assert "gloo (us)" in result.stderr


@pytest.mark.parametrize("env, args, words", [
    ({"OMPI_COMM_WORLD_SIZE": "2"}, ["--backend", "mpi"], "starts its ranks itself"),
    ({}, ["--backend", "mpi", "--init-sizes", "8"], "--init-sizes times init_process_group('gloo')"),
])
def test_mpi_options_that_cannot_work_are_refused(env, args, words):
    result = subprocess.run([sys.executable, "-m", "distlib_bench", "collectives", *args],
                            capture_output=True, text=True, timeout=120, env={**os.environ, **env})
    assert result.returncode == 2 and words in result.stderr and "Traceback" not in result.stderr, result.stderr


def test_backend_mpi_without_mpi4py_says_what_to_install(monkeypatch, capsys):
    from distlib_bench import mpi_group

    monkeypatch.setattr(mpi_group, "why_not_available", lambda: "mpi4py is not importable")
    assert exit_code(["--backend", "mpi"]) == 2
    err = capsys.readouterr().err
    assert "--backend mpi needs mpi4py and mpirun: mpi4py is not importable (pip install 'distlib-c10d[mpi]')" in err


# -- the MPI job itself: every wait has a deadline, a dead rank is an error, nothing is left --------


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_rank_of_the_mpi_job_that_dies_is_an_error_and_nothing_is_left():
    need_mpi()
    from distlib_bench.mpi_group import MpiGroup

    group = MpiGroup(2, ["mpi4py"], timeout_s=60)
    try:
        replies = group.measure("mpi4py", "all_reduce", 1024, "float32", 3, 1, True)
        assert [r["rank"] for r in replies] == [0, 1] and all(r["wrong"] is None for r in replies)
        os.kill(group.pids[1], signal.SIGKILL)
        with pytest.raises(BenchError, match=r"MPI rank \d .*(went away|broke)"):
            group.measure("mpi4py", "all_reduce", 1024, "float32", 3, 1, False)
    finally:
        started = time.monotonic()
        group.stop(grace=10)
    assert time.monotonic() - started < 30
    assert group.proc.poll() is not None and not any(_alive(pid) for pid in group.pids)


def test_mpi_ranks_that_never_connect_time_out(monkeypatch):
    from distlib_bench import mpi_group

    monkeypatch.setattr(mpi_group, "mpirun_command",
                        lambda n, argv: [sys.executable, "-c", "import time; time.sleep(120)"])
    started = time.monotonic()
    with pytest.raises(BenchError, match="2 of 2 MPI ranks did not connect within 2 s"):
        mpi_group.MpiGroup(2, ["mpi4py"], timeout_s=2)
    assert time.monotonic() - started < 15


def test_an_mpirun_that_fails_shows_what_it_said(monkeypatch):
    from distlib_bench import mpi_group

    monkeypatch.setattr(mpi_group, "mpirun_command",
                        lambda n, argv: [sys.executable, "-c", "print('no slots for 2 ranks'); raise SystemExit(3)"])
    with pytest.raises(BenchError, match=r"(?s)mpirun exited with 3 before its 2 ranks connected \(0 did\):.*"
                                         r"no slots for 2 ranks"):
        mpi_group.MpiGroup(2, ["mpi4py"], timeout_s=30)
