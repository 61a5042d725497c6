"""``distlib gpu-info``: the version texts, the report's lines for each situation, and the command
itself on this machine (no cupy in the test venv: one line, exit 1). The report with cupy and
without a device is checked in the GPU image (tests/containers/test_gpu_image.py); with a device
by tests/gpu/test_gpu_info_gpu.py."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from distlib import gpu_info


@pytest.mark.parametrize("code, text", [(23203, "2.32.3"), (21003, "2.10.3"), (22907, "2.29.7"), (2708, "2.7.8")])
def test_nccl_version_codes(code, text):
    assert gpu_info.nccl_version_text(code) == text


@pytest.mark.parametrize("code, text", [(12090, "12.9"), (12020, "12.2"), (13000, "13.0"), (11080, "11.8")])
def test_cuda_version_codes(code, text):
    assert gpu_info.cuda_version_text(code) == text


def test_a_device_line_from_cudas_properties():
    props = {"name": b"NVIDIA H100 80GB HBM3", "totalGlobalMem": 85045149696, "major": 9, "minor": 0,
             "pciDomainID": 0, "pciBusID": 0x18, "pciDeviceID": 0}
    assert gpu_info.device_line(3, props) == \
        "cuda:3 NVIDIA H100 80GB HBM3, compute capability 9.0, 79.2 GiB, PCI 0000:18:00.0"


LIBS = {"cupy": "14.2.0", "cuda_runtime": "12.9", "nvrtc": "12.9", "nccl": "2.32.3"}


def test_lines_without_cupy_are_one():
    facts = {"cupy": None, "problem": "cupy is not installed (...): pip install 'distlib-c10d[gpu]'"}
    assert gpu_info.lines(facts) == [facts["problem"]]


def test_lines_without_nccl():
    facts = {**LIBS, "nccl": None, "problem": "NCCL library not found by cupy 14.2.0 (...)", "devices": []}
    assert gpu_info.lines(facts) == ["cupy 14.2.0 (CUDA runtime 12.9, NVRTC 12.9)", facts["problem"]]


def test_lines_without_a_device_are_two():
    facts = {**LIBS, "devices": [], "problem": "no CUDA device visible (cupy: cudaErrorNoDevice: no CUDA-capable "
                                               "device is detected)"}
    assert gpu_info.lines(facts) == ["cupy 14.2.0 (CUDA runtime 12.9, NVRTC 12.9), NCCL 2.32.3", facts["problem"]]


def test_lines_with_devices_and_checks():
    facts = {**LIBS, "driver": "12.8", "devices": ["cuda:0 A", "cuda:1 B"], "checks": ["ok", "CUDARuntimeError: x"],
             "problem": "check failed on cuda:1: CUDARuntimeError: x"}
    assert gpu_info.lines(facts) == [
        "cupy 14.2.0 (CUDA runtime 12.9, NVRTC 12.9), NCCL 2.32.3",
        "CUDA driver 12.8, 2 device(s):",
        "cuda:0 A: kernel and NCCL all_reduce ok",
        "cuda:1 B: kernel and NCCL all_reduce CUDARuntimeError: x",
        "check failed on cuda:1: CUDARuntimeError: x",
    ]


def _command(*args):
    return subprocess.run([sys.executable, "-m", "distlib.cli", "gpu-info", *args], capture_output=True, text=True,
                          timeout=120)


@pytest.mark.skipif(importlib.util.find_spec("cupy") is not None, reason="cupy is installed here")
def test_the_command_without_cupy_says_so_in_one_line():
    done = _command()
    assert done.returncode == 1
    assert done.stdout.strip().splitlines() == [
        "cupy is not installed (No module named 'cupy'): pip install 'distlib-c10d[gpu]' (cupy-cuda12x and "
        "nvidia-nccl-cu12)"]
    assert done.stderr == ""
    done = _command("--json", "-")
    assert done.returncode == 1 and json.loads(done.stdout)["ok"] is False
    assert "cupy is not installed" in done.stderr  # the text goes to stderr when the JSON takes stdout
