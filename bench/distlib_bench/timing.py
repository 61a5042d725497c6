"""Timing and statistics of the benchmarks: a shared start instant, a timed loop, quantiles,
the paired ratio of two implementations measured back to back, histograms.

Implementations run interleaved, round by round (distlib, torch, distlib, torch, ...:
``interleaved``), so a slow phase of a noisy machine hits both; a row reports the median over
rounds.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple


def sleep_until(when: float, clock: Callable[[], float] = time.perf_counter) -> None:
    """Sleep until ``clock() >= when`` (one shared instant for many processes: on Linux
    perf_counter is CLOCK_MONOTONIC, the same in every process); the last ms is spun."""
    while True:
        left = when - clock()
        if left <= 0:
            return
        if left > 0.002:
            time.sleep(left - 0.001)


@dataclass
class LoopResult:
    """``ops`` calls in ``seconds``; ``latencies`` (seconds per call) when recorded."""

    ops: int
    seconds: float
    latencies: List[float] = field(default_factory=list)

    @property
    def rate(self) -> float:
        return self.ops / self.seconds if self.seconds > 0 else float("nan")

    def latency_quantile(self, q: float) -> float:
        return quantile(self.latencies, q) if self.latencies else float("nan")


def timed_loop(fn: Callable[[int], Any], seconds: float, batch: int = 64,
               record: bool = True, min_ops: int = 1) -> LoopResult:
    """Call ``fn(i)`` for i = 0, 1, ... for about ``seconds`` (checked every ``batch`` calls,
    at least ``min_ops`` calls), timing each call when ``record``."""
    clock = time.perf_counter
    latencies: List[float] = []
    lat_append = latencies.append
    n = 0
    start = clock()
    end = start + seconds
    while True:
        if record:
            for _ in range(batch):
                t0 = clock()
                fn(n)
                lat_append(clock() - t0)
                n += 1
        else:
            for _ in range(batch):
                fn(n)
                n += 1
        if n >= min_ops and clock() >= end:
            break
    return LoopResult(n, clock() - start, latencies)


# -- statistics ----------------------------------------------------------------------------------


def quantile(values: Sequence[float], q: float) -> float:
    """The q-quantile (0..1) by linear interpolation; NaN for no values."""
    data = sorted(v for v in values if v is not None and not math.isnan(v))
    if not data:
        return float("nan")
    if len(data) == 1:
        return data[0]
    pos = q * (len(data) - 1)
    lo = int(math.floor(pos))
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def median(values: Sequence[float]) -> float:
    return quantile(values, 0.5)


def spread(values: Sequence[float]) -> float:
    """max/min - 1 over the rounds (0.25 = the best round was 25% above the worst)."""
    data = [v for v in values if v is not None and not math.isnan(v) and v > 0]
    if len(data) < 2:
        return 0.0
    return max(data) / min(data) - 1


@dataclass
class PairedRatio:
    """The median of per-pair ratios and a 95% bootstrap interval around it."""

    median: float
    low: float
    high: float
    pairs: int

    def to_json(self) -> Dict[str, Any]:
        return {"median": json_number(self.median), "ci95": [json_number(self.low), json_number(self.high)],
                "pairs": self.pairs}


def paired_ratio(numerators: Sequence[float], denominators: Sequence[float], resamples: int = 2000,
                 seed: int = 0) -> PairedRatio:
    """Median of ``numerators[i] / denominators[i]`` with a 95% percentile-bootstrap interval.

    For loads whose speed drifts by tens of percent within seconds on a shared VM: two
    implementations measured back to back form a pair that saw the same machine, so the
    ratio within each pair cancels the drift that separate medians keep. The fixed seed makes
    a report reproducible from its own numbers.
    """
    ratios = [a / b for a, b in zip(numerators, denominators, strict=False) if a > 0 and b > 0]
    if not ratios:
        nan = float("nan")
        return PairedRatio(nan, nan, nan, 0)
    rng = random.Random(seed)
    n = len(ratios)
    boots = sorted(median([ratios[rng.randrange(n)] for _ in range(n)]) for _ in range(resamples))
    return PairedRatio(median(ratios), quantile(boots, 0.025), quantile(boots, 0.975), n)


def histogram(values: Iterable[float], edges: Sequence[Tuple[float, str]]) -> Dict[str, int]:
    """Count values into labelled buckets: ``edges`` = [(upper bound, label), ...] in
    increasing order; values at or over the last bound go into the last label."""
    counts = {label: 0 for _, label in edges}
    last = edges[-1][1]
    for value in values:
        for bound, label in edges:
            if value < bound:
                counts[label] += 1
                break
        else:
            counts[last] += 1
    return {label: n for label, n in counts.items() if n}


def interleaved(rounds: int, impls: Sequence[str]) -> List[Tuple[int, str]]:
    """(round, impl) pairs in the order they should run: a, b, a, b, ..."""
    return [(r, impl) for r in range(rounds) for impl in impls]


def json_number(x: float) -> Optional[float]:
    """``x`` for a JSON report: None for NaN or infinity (not measured, failed), floats rounded."""
    if x is None or (isinstance(x, float) and (math.isnan(x) or math.isinf(x))):
        return None
    return round(x, 9) if isinstance(x, float) else x
