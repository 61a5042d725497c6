"""Whether cupy, its NCCL library and a CUDA device are here, and if not, which one is missing.

The three can fail separately: cupy not installed; cupy installed but ``libnccl.so.2`` not
found (cupy looks through cuda-pathfinder, the ``nvidia-nccl-cu12`` wheel, then the system);
both present but no device or no driver (``getDeviceCount`` raises, e.g.
``cudaErrorInsufficientDriver``, or returns 0). ``is_nccl_available()`` needs the first two,
as torch's needs NCCL built in; a communicator needs all three. Each answer is one line, so
``init_process_group("nccl")`` can say exactly what to install or fix.

The backends find cupy here, on first use, so that CPU-only processes never pay for it; the
fake device (distlib/testing/fake_gpu) comes in through ``install`` (the backends see no
difference).
"""

from __future__ import annotations

import threading
import warnings
from dataclasses import dataclass
from typing import Any, Optional

_lock = threading.Lock()
_cached: Optional["CudaStatus"] = None


@dataclass(frozen=True)
class CudaStatus:
    """What this process can use: the modules (None when missing), the device count, and
    a one-line ``problem`` naming the first missing part ("" when nothing is missing)."""

    cupy: Any
    nccl: Any
    devices: int
    problem: str

    @property
    def nccl_loads(self) -> bool:
        return self.nccl is not None

    @property
    def usable(self) -> bool:
        return self.nccl is not None and self.devices > 0


def _probe() -> CudaStatus:
    try:
        import cupy
    except ImportError as exc:
        return CudaStatus(None, None, 0, f"cupy is not installed ({exc}): pip install 'distlib-c10d[gpu]' "
                                         f"(cupy-cuda12x and nvidia-nccl-cu12)")
    except Exception as exc:  # noqa: BLE001 - a broken install must still give one line
        return CudaStatus(None, None, 0, f"cupy failed to import: {type(exc).__name__}: {exc}")
    with warnings.catch_warnings():
        # cupy warns at length (with an install command) when NCCL does not load; we say it once.
        warnings.simplefilter("ignore")
        try:
            from cupy.cuda import nccl
        except ImportError as exc:
            nccl, why = None, str(exc)
        else:
            why = "cupy.cuda.nccl.available is False"
    if nccl is None or not getattr(nccl, "available", False):
        return CudaStatus(cupy, None, 0, f"NCCL library not found by cupy {cupy.__version__} ({why}): "
                                         f"pip install nvidia-nccl-cu12 (CUPY_DEBUG_LIBRARY_LOAD=1 shows "
                                         f"where cupy looked)")
    try:
        count = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as exc:  # noqa: BLE001 - CUDARuntimeError, or a driver library that is missing
        return CudaStatus(cupy, nccl, 0, f"no CUDA device (cupy: {exc})")
    if count <= 0:
        return CudaStatus(cupy, nccl, 0, "no CUDA device (cupy: getDeviceCount() is 0; check "
                                         "CUDA_VISIBLE_DEVICES and the container's GPU request)")
    return CudaStatus(cupy, nccl, count, "")


def status(refresh: bool = False) -> CudaStatus:
    """The probe's answer, computed once per process (``refresh`` computes it again)."""
    global _cached
    with _lock:
        if _cached is None or refresh:
            _cached = _probe()
        return _cached


def install(cupy: Any, nccl: Any, devices: int) -> CudaStatus:
    """Use ``cupy`` and ``nccl`` (modules with cupy's API) instead of importing cupy: the seam
    where the fake device goes (distlib/testing/fake_gpu: the CPU suite, a user's CPU CI). Returns the new status."""
    global _cached
    with _lock:
        _cached = CudaStatus(cupy, nccl, devices, "")
        return _cached


def require() -> CudaStatus:
    """The status when a device can be used; else RuntimeError, in torch's words plus why."""
    found = status()
    if found.nccl is None:
        raise RuntimeError(f"Distributed package doesn't have NCCL built in: distlib's nccl backend needs cupy "
                           f"and its NCCL library, and here {found.problem}")
    if not found.usable:
        raise RuntimeError(f"ProcessGroupNCCL is only supported with GPUs, no GPUs found! distlib's nccl backend "
                           f"has cupy and NCCL here, but {found.problem}")
    return found


def cupy_major(cupy) -> int:
    """cupy's major version: 14 and later take the unique id as bytes, older ones a tuple."""
    try:
        return int(str(cupy.__version__).split(".")[0])
    except ValueError:
        return 0
