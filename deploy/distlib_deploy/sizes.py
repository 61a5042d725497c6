"""Byte sizes as people type and read them: ``64K``, ``4KiB``, ``16MiB``, ``1G`` (binary units,
as nccl-tests' ``-b``/``-e``), for the benchmarks' and the jobs' options and tables."""

from __future__ import annotations

import re
from typing import List

UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20,
         "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30}


def parse_size(text: str) -> int:
    """``4KiB``, ``4k``, ``1MiB``, ``16M``, ``4096`` → bytes; ValueError for anything else."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in UNITS:
        raise ValueError(f"not a size: {text!r} (examples: 4KiB, 1MiB, 16MiB, 4096)")
    return int(float(match.group(1)) * UNITS[match.group(2).lower()])


def parse_sizes(text: str) -> List[int]:
    """Comma-separated sizes, each positive."""
    sizes = [parse_size(part) for part in text.split(",") if part.strip()]
    if any(s <= 0 for s in sizes):
        raise ValueError(f"sizes must be positive: {text!r}")
    return sizes


def format_size(nbytes: int) -> str:
    """64 MiB, 4 KiB, 1.5 MiB, 100 B."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    if nbytes >= 1 << 20:
        return f"{nbytes / (1 << 20):.1f} MiB"
    if nbytes >= 1 << 10:
        return f"{nbytes / (1 << 10):.1f} KiB"
    return f"{nbytes} B"
