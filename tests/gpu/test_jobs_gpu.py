"""The GPU image's command and the cluster's job on a real GPU: `distlib gpu-info --check`, and
`distlib_deploy.jobs.train_dp` with NCCL (its model on cupy arrays, each rank on
cuda:LOCAL_RANK) under distlib-run. Without a device every test here skips, saying what cupy
said (see tests/tools/test_gpu_info.py and test_train_dp.py for what runs everywhere)."""

import json
import os
import subprocess
import sys

import pytest

from .conftest import no_device_reason

_REASON = no_device_reason()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_REASON is not None, reason=_REASON or "")]


def _device_count() -> int:
    from distlib.backends import cupy_env

    return cupy_env.status().devices


def test_gpu_info_check_passes_on_every_device():
    done = subprocess.run([sys.executable, "-m", "distlib.cli", "gpu-info", "--check", "--json", "-"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    facts = json.loads(done.stdout)
    assert facts["ok"] and len(facts["devices"]) == _device_count()
    assert facts["checks"] == ["ok"] * _device_count()
    lines = done.stderr.strip().splitlines()
    assert lines[0].startswith("cupy ") and lines[1].startswith("CUDA driver ")
    assert all(line.endswith(": kernel and NCCL all_reduce ok") for line in lines[2:])


@pytest.mark.parametrize("backend", ["nccl", "cpu:gloo,cuda:nccl"])
@pytest.mark.parametrize("nproc", [1, 2])
def test_train_dp_on_cupy_arrays(backend, nproc, tmp_path):
    """One GPU per rank where there are enough (as the cluster gives them); else the ranks
    share GPUs (cuda:LOCAL_RANK mod the count), each with its own NCCL_HOSTID (one_gpu_rank)."""
    count = _device_count()
    shared = ["-m", "tests.gpu.one_gpu_rank", "distlib_deploy.jobs.train_dp"] if nproc > count else \
        ["-m", "distlib_deploy.jobs.train_dp"]
    report = tmp_path / "report.json"
    done = subprocess.run(
        [sys.executable, "-m", "distlib.cli", "run", "--nproc-per-node", str(nproc), *shared,
         "--epochs", "3", "--steps", "20", "--bench-sizes", "4KiB,16MiB", "--timeout", "120",
         "--report-json", str(report)],
        capture_output=True, text=True, timeout=600, env={**os.environ, "DISTLIB_BACKEND": backend})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    doc = json.loads(report.read_text())
    assert doc["ok"] and doc["run"]["backend"] == backend and doc["model"]["arrays"] == "cupy"
    assert [r["device"] for r in doc["ranks"]] == [f"cuda:{i % count}" for i in range(nproc)]  # cuda:LOCAL_RANK
    losses = [e["loss"] for e in doc["epochs"]]
    assert losses[-1] < losses[0], losses
    assert all(b["time_us"] > 0 for b in doc["bandwidth"])
