"""``make test-gpu``'s runner, the parts a machine without a GPU can check: the one-line refusal,
and the summary it makes from pytest's report and the benchmark's JSON."""

import json
import os
import subprocess
import sys

import pytest

from distlib_bench import collectives as cpu
from distlib_bench import collectives_cuda as cuda
from distlib_bench.tables import Printer

from . import run_gpu_suite as suite

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_without_a_gpu_it_says_why_in_one_line_and_runs_nothing(tmp_path):
    from distlib.backends import cupy_env

    if cupy_env.status().usable:
        pytest.skip("a CUDA device is here")
    done = subprocess.run([sys.executable, "-m", "tests.gpu.run_gpu_suite"], capture_output=True, text=True,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT, "GPU_OUT": str(tmp_path / "out")},
                          timeout=60)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith("make test-gpu needs a CUDA GPU with cupy and NCCL (and pytest): here ")
    assert done.stderr.strip().endswith("Nothing was run.") and len(done.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_the_summary_counts_tests_and_names_the_failed(tmp_path):
    report = tmp_path / "tests.xml"
    report.write_text(
        '<testsuites><testsuite tests="4" failures="1" errors="0" skipped="1">'
        '<testcase classname="tests.gpu.test_nccl_gpu" name="test_a[ws2]"/>'
        '<testcase classname="tests.gpu.test_nccl_gpu" name="test_b"><failure message="x"/></testcase>'
        '<testcase classname="tests.gpu.test_jobs_gpu" name="test_c"><skipped/></testcase>'
        '<testcase classname="tests.gpu.test_jobs_gpu" name="test_d"/></testsuite></testsuites>')
    assert suite._tests_summary(report) == ["tests: 2 passed, 1 failed, 1 skipped",
                                            "  FAILED test_nccl_gpu::test_b"]
    assert suite._tests_summary(tmp_path / "absent.xml") == ["tests: no report (pytest did not finish)"]


def test_the_summary_gives_each_targets_figures_ratio_and_result(tmp_path):
    parser = cpu.build_parser()
    cuda.set_defaults(parser)
    args = parser.parse_args(["--device", "cuda", "--ops", "all_reduce", "--nproc", "1"])
    bench = cuda.CudaCollectivesBench(args, ["distlib", "torch"], Printer(quiet=True), devices=1)
    bench._plan()
    bench._add_targets()
    rows = {(calls, flight): row for calls, flight, row in bench.per_call_rows}
    rows[(3000, False)].add("distlib", 10e-6)
    rows[(3000, False)].add("torch", 26.8e-6)
    doc = {"environment": {"gpus": ["NVIDIA H200"]}, "failures": [],
           "targets": [dict(row.to_json(["distlib", "torch"], "torch"), label=label) for label, row in bench.targets]}
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(doc))
    lines = suite._bench_summary(path, "1 rank")
    assert lines[0] == "bench 1 rank: NVIDIA H200"
    assert ("  nccl 8 B all_reduce, 3000 back to back, 1 rank(s): distlib 10.0 us, torch 26.8 us, ratio 2.68x "
            "(<= 0.5x torch nccl's time per call) -> PASS") in lines
    assert any(line.startswith("  nccl 8 B all_reduce, 10,000 in flight vs 10, 1 rank(s): distlib -") for line in lines)
    assert suite._bench_summary(tmp_path / "absent.json", "2 ranks") == ["bench 2 ranks: no JSON (it did not finish)"]
