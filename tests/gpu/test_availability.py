"""is_nccl_available and the one-line errors of init_process_group("nccl"), for real: cupy
hidden from a subprocess, cupy's NCCL binding hidden, and cupy present without a device."""

import importlib.util
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: The probe, run in a fresh interpreter after hiding the modules named in HIDE.
PROBE = textwrap.dedent("""
    import json, sys
    for name in HIDE:
        sys.modules[name] = None  # "import name" now raises ImportError, as if not installed
    import distlib as dist
    out = {"nccl": dist.is_nccl_available(), "backend_nccl": dist.is_backend_available("nccl")}
    try:
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
        out["init"] = "no error"
    except RuntimeError as exc:
        out["init"] = f"{type(exc).__name__}: {exc}"
    dist.init_process_group(store=dist.HashStore(), rank=0, world_size=1)  # backend=None
    out["default_backend"] = str(dist.get_backend())
    dist.destroy_process_group()
    print(json.dumps(out))
""")


def _probe(hide):
    code = f"HIDE = {list(hide)!r}\n{PROBE}"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def _cupy_status():
    """The probe's status in this process; skips the test when cupy is not installed."""
    if importlib.util.find_spec("cupy") is None:
        pytest.skip("cupy not installed: this case needs cupy itself ('pip install -e .[gpu]')")
    from distlib.backends import cupy_env

    return cupy_env.status()


def _one_line(text):
    assert "\n" not in text, text
    return text


def test_without_cupy():
    out = _probe(["cupy"])
    assert out["nccl"] is False and out["backend_nccl"] is False
    assert _one_line(out["init"]).startswith(
        "RuntimeError: Distributed package doesn't have NCCL built in: distlib's nccl backend needs cupy and its "
        "NCCL library, and here cupy is not installed")
    assert "pip install 'distlib-c10d[gpu]'" in out["init"]
    assert out["default_backend"] == "gloo"


def test_cupy_without_its_nccl_library():
    _cupy_status()
    out = _probe(["cupy_backends.cuda.libs.nccl"])  # cupy.cuda.nccl then reports available = False
    assert out["nccl"] is False and out["backend_nccl"] is False
    assert _one_line(out["init"]).startswith("RuntimeError: Distributed package doesn't have NCCL built in: ")
    assert "and here NCCL library not found by cupy" in out["init"]
    assert "pip install nvidia-nccl-cu12" in out["init"]
    assert out["default_backend"] == "gloo"


def test_cupy_and_nccl_without_a_device():
    status = _cupy_status()
    if status.usable:
        pytest.skip(f"a CUDA device is here ({status.devices}): tests/gpu/test_nccl_gpu.py covers it")
    if not status.nccl_loads:
        pytest.skip(status.problem)
    out = _probe([])
    assert out["nccl"] is True and out["backend_nccl"] is True  # as torch's, for a CUDA build without a GPU
    assert _one_line(out["init"]).startswith(
        "RuntimeError: ProcessGroupNCCL is only supported with GPUs, no GPUs found! distlib's nccl backend has cupy "
        "and NCCL here, but no CUDA device (cupy: ")
    assert out["default_backend"] == "gloo"  # backend=None maps cuda only where a device is


def test_the_probe_names_the_first_missing_part_in_this_process():
    from distlib.backends import cupy_env

    status = cupy_env.status()
    assert status.problem == "" if status.usable else status.problem
    assert status.usable == (status.nccl is not None and status.devices > 0)
