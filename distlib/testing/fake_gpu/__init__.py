"""A CPU stand-in for CUDA and NCCL under distlib's ``nccl`` backend (cuda.py, nccl.py).

``install(devices)`` puts it under the backend (``distlib.backends.cupy_env.install``) and, for
the job's own code, as the ``cupy`` module: a job written for ``init_process_group("nccl")``
and cupy arrays then runs on CPU with correct numbers (each collective is computed by numpy on
every rank's real data, exchanged through files in a directory all ranks share). The harness
does it in every process of a job with ``Job(..., fake_gpus=N)`` (docs/testing.md: what the
fake offers of cupy's API, and what it cannot stand in for).
"""

from __future__ import annotations

import os
import sys
from typing import Any, Optional


def install(devices: int = 1, directory: Optional[str] = None, **options: Any) -> Any:
    """The fake device in this process, before ``init_process_group``: ``devices`` GPUs,
    collectives exchanged through ``directory`` (default: the run directory's ``fake-gpu``);
    ``options`` go to ``cuda.install`` (delays, on_violation, ...). Returns the fake ``cupy``."""
    from . import cuda

    if directory is None:
        from .. import settings

        directory = os.path.join(settings.run_dir() or ".", "fake-gpu")
    os.makedirs(directory, exist_ok=True)
    cuda.install(directory, devices=devices, **options)
    sys.modules["cupy"] = cuda.cupy  # type: ignore[assignment]
    return cuda.cupy
