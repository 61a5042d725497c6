"""torch's errors for ``monitored_barrier``, which every backend raises alike: rank 0's, naming
the ranks that did not come, and the one the others get when rank 0 tells them so. Here, and
not in one backend's algorithms, because gloo and mpi both raise them."""

from __future__ import annotations

from typing import List

from ..deadline import format_duration
from ..errors import DistBackendError


def not_passed(failed: List[int], timeout_s: float, wait_all_ranks: bool) -> DistBackendError:
    """Rank 0's error for the ranks that did not reach monitored_barrier (torch's words)."""
    ms = int(timeout_s * 1000)
    if wait_all_ranks:
        return DistBackendError(f"Ranks {', '.join(map(str, failed))} failed to pass monitoredBarrier in {ms} ms")
    return DistBackendError(f"Rank {failed[0]} failed to pass monitoredBarrier in {ms} ms")


def told_failed(timeout_s: float) -> DistBackendError:
    """The error of a rank that came to monitored_barrier and was told by rank 0 that others did not."""
    return DistBackendError(f"monitored_barrier failed: rank 0 reported that other ranks did not reach the "
                            f"barrier within {format_duration(timeout_s)}")
