"""What ``distlib bench collectives`` measures (bench/collectives.py describes how): the
implementations, the ops and what their sizes mean, nccl-tests' bandwidth arithmetic, the
targets, and ``SweepPoint``, one (op, size) of a sweep with its row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from .cases import CHUNKED
from .results import TORCH, Row, load_targets

#: Raw mpi4py (the floor) and, with --backend mpi, distlib's gloo backend beside its mpi backend.
MPI4PY, DISTLIB_GLOO = "mpi4py", "distlib-gloo"
BACKENDS = ("gloo", "mpi", "nccl")
#: Short names of the implementations in the tables' headers.
SHORT = {TORCH: "torch", MPI4PY: "mpi4py", DISTLIB_GLOO: "gloo"}

#: Ops the benchmark knows, in the order tables print. The sizing word says what "size" means.
OPS = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast", "reduce", "all_to_all_single")
DEFAULT_OPS = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast", "all_to_all_single")
#: Short names people type (nccl-tests' binaries are all_gather_perf, reduce_scatter_perf, alltoall_perf).
ALIASES = {"all_gather": "all_gather_into_tensor", "reduce_scatter": "reduce_scatter_tensor",
           "all_to_all": "all_to_all_single", "alltoall": "all_to_all_single", "allreduce": "all_reduce",
           "allgather": "all_gather_into_tensor", "reducescatter": "reduce_scatter_tensor"}
#: What the size column means, per op (printed above each table).
SIZE_MEANS = {
    "all_reduce": "size = each rank's buffer",
    "broadcast": "size = the buffer, from rank 0",
    "reduce": "size = each rank's buffer, to rank 0",
    "all_gather_into_tensor": "size = the gathered output",
    "reduce_scatter_tensor": "size = the input that is scattered",
    "all_to_all_single": "size = what each rank sends in all",
}
#: numpy dtypes both implementations move and sum (bool and complex are left out: MIN/MAX and
#: torch's gloo support differ).
DTYPES = ("float32", "float64", "float16", "int8", "uint8", "int32", "int64")

MIB = 1 << 20

#: The targets (targets.json) and the rows they apply to.
TARGETS = load_targets("collectives")
BUSBW = TARGETS["all_reduce_busbw"]
INIT_RELATIVE_WS = TARGETS["init_relative"]["applies"]["ranks"]
INIT_ABSOLUTE_WS = TARGETS["init_absolute"]["applies"]["ranks"]
#: --backend mpi: the same all_reduce rows against raw mpi4py.
TARGETS_MPI = load_targets("collectives_mpi")


def busbw_factor(op: str, nranks: int) -> float:
    """nccl-tests' bus-bandwidth factor: what busbw multiplies algbw by, so that busbw is the
    bandwidth each rank's link carries (an all_reduce moves 2(n-1)/n of its buffer per rank)."""
    n = nranks
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    if op in CHUNKED:
        return (n - 1) / n
    if op in ("broadcast", "reduce"):
        return 1.0
    raise ValueError(f"unknown op {op!r}")


def op_size(op: str, nbytes: int, itemsize: int, nranks: int) -> Tuple[int, int]:
    """(bytes, count) that a requested size becomes for ``op``: whole elements, at least one;
    for the chunked ops a multiple of N elements (one chunk per rank, one element at least)."""
    count = max(1, nbytes // itemsize)
    if op in CHUNKED:
        count = max(1, count // nranks) * nranks
    return count * itemsize, count


def size_sweep(min_bytes: int, max_bytes: int, factor: int) -> List[int]:
    """min, min*f, min*f^2, ... up to max inclusive (nccl-tests' -b/-e/-f)."""
    sizes = []
    size = min_bytes
    while size <= max_bytes:
        sizes.append(size)
        size *= factor
    return sizes


def algbw_gbs(nbytes: int, seconds: float) -> float:
    """Algorithm bandwidth in GB/s (10^9 bytes, as nccl-tests)."""
    if not seconds or seconds <= 0 or math.isnan(seconds):
        return float("nan")
    return nbytes / seconds / 1e9


@dataclass
class SweepPoint:
    """One (op, size) of the sweep and its row."""

    op: str
    nbytes: int
    count: int
    row: Row
    validated: Dict[str, Optional[bool]]
