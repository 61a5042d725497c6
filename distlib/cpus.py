"""How many CPUs this process may run on: what busy-polling, the launcher's worker count and
the mesh's socket buffers are sized by."""

from __future__ import annotations

import os


def usable_cpus() -> int:
    """CPUs in this process's affinity mask (``taskset``, a container's cpuset); the machine's
    count where the mask cannot be read. torchrun counts os.cpu_count() instead, which
    over-counts inside a cpuset."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1
