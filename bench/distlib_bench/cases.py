"""What one rank of ``distlib bench collectives`` does for one op at one size: its buffers, the
validation pattern that proves a result right, the call, and the timing. Shared by the forked
ranks of the gloo groups (distlib's, torch's) and the ranks under mpirun (distlib's mpi backend
and raw mpi4py: bench/mpi_ranks.py), so that every implementation is filled, checked and timed
the same way.

Validation: each rank fills its buffers with a position-dependent pattern (period 251, a
prime, so chunk boundaries never line up with it; different per rank and per chunk), runs
the op once and checks every element; the timed ops then run on zeroed buffers (repeated
in-place sums would otherwise grow to inf).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

#: Ops whose buffer is cut into one chunk per rank: sizes must be a multiple of N elements.
CHUNKED = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single")
#: Validation pattern period: a prime, so chunk boundaries (multiples of count/N) never line
#: up with it and a chunk delivered to the wrong place shows.
PATTERN_PERIOD = 251


def _pattern_period(np, dtype, offset: int, phase: int = 0):
    """One period of the validation pattern: ((phase + j) % P) + offset, cast to ``dtype``
    (integer casts wrap the same way on every rank, so expectations stay exact)."""
    j = (np.arange(PATTERN_PERIOD, dtype=np.int64) + phase) % PATTERN_PERIOD
    return (j + offset).astype(dtype)


def _tile(np, period, count: int, out=None):
    """``period`` repeated over ``count`` elements (into ``out`` when given): a broadcast
    assignment per whole period, so a 64 MiB pattern costs about a memcpy."""
    if out is None:
        out = np.empty(count, dtype=period.dtype)
    p = len(period)
    whole = count // p * p
    if whole:
        out[:whole].reshape(-1, p)[:] = period
    out[whole:] = period[: count - whole]
    return out


def _summed_period(np, dtype, offsets: Sequence[int], phase: int = 0):
    """The period of sum over ranks of their patterns, summed in ``dtype`` as a reduction
    would (wrapping for integers)."""
    acc = np.zeros(PATTERN_PERIOD, dtype=dtype)
    for off in offsets:
        acc = np.add(acc, _pattern_period(np, dtype, off, phase), dtype=dtype)
    return acc


class Case:
    """One op at one size on one rank: its numpy buffers, how to fill them with the
    validation pattern, the call, and the check of the result.

    Buffers are numpy arrays; for torch they are wrapped with ``torch.from_numpy`` (shared
    memory), so the same fill and check code serves both implementations."""

    def __init__(self, op: str, count: int, dtype: str, rank: int, nranks: int):
        import numpy as np

        self.np = np
        self.op, self.count, self.rank, self.n = op, count, rank, nranks
        self.dtype = np.dtype(dtype)
        self.chunk = count // nranks if op in CHUNKED else count
        if op in ("all_reduce", "broadcast", "reduce"):
            self.buf = np.zeros(count, self.dtype)
        elif op == "all_gather_into_tensor":
            self.inp, self.out = np.zeros(self.chunk, self.dtype), np.zeros(count, self.dtype)
        elif op == "reduce_scatter_tensor":
            self.inp, self.out = np.zeros(count, self.dtype), np.zeros(self.chunk, self.dtype)
        elif op == "all_to_all_single":
            self.inp, self.out = np.zeros(count, self.dtype), np.zeros(count, self.dtype)
        else:
            raise ValueError(f"unknown op {op!r}")

    def bind(self, dist, wrap: Callable) -> Callable[[], Any]:
        """The call to time, on ``dist`` (distlib or torch.distributed)."""
        op = self.op
        if op == "all_reduce":
            b = wrap(self.buf)
            return lambda: dist.all_reduce(b)
        if op == "broadcast":
            b = wrap(self.buf)
            return lambda: dist.broadcast(b, 0)
        if op == "reduce":
            b = wrap(self.buf)
            return lambda: dist.reduce(b, 0)
        i, o = wrap(self.inp), wrap(self.out)
        fn = getattr(dist, op)
        return lambda: fn(o, i)

    def _offsets_a2a(self, src: int, dst: int) -> int:
        return 1 + src * self.n + dst

    def fill(self) -> None:
        np, dt, r, n, c = self.np, self.dtype, self.rank, self.n, self.chunk
        op = self.op
        if op in ("all_reduce", "reduce"):
            _tile(np, _pattern_period(np, dt, r + 1), self.count, self.buf)
        elif op == "broadcast":
            if r == 0:
                _tile(np, _pattern_period(np, dt, 1), self.count, self.buf)
            else:
                self.buf[:] = 0
        elif op == "all_gather_into_tensor":
            _tile(np, _pattern_period(np, dt, 7 * r + 1), c, self.inp)
            self.out[:] = 0
        elif op == "reduce_scatter_tensor":
            _tile(np, _pattern_period(np, dt, r + 1), self.count, self.inp)
            self.out[:] = 0
        else:  # all_to_all_single: chunk d of rank s carries (s, d)
            for d in range(n):
                _tile(np, _pattern_period(np, dt, self._offsets_a2a(r, d)), c, self.inp[d * c:(d + 1) * c])
            self.out[:] = 0

    def _same(self, got, want) -> bool:
        np = self.np
        if self.dtype.kind == "f" and self.op in ("all_reduce", "reduce", "reduce_scatter_tensor") \
                and self.dtype.itemsize < 4:
            # float16 sums past 2048 round, and the order of the sum may differ between ranks'
            # algorithms: allow the rounding, nothing more.
            return bool(np.allclose(got, want, rtol=2e-3 * self.n, atol=0))
        return bool(np.array_equal(got, want))

    def check(self) -> Optional[str]:
        """None if this rank's result is right; else what is wrong (the first bad index)."""
        np, dt, r, n, c = self.np, self.dtype, self.rank, self.n, self.chunk
        op = self.op
        expected: List[Tuple[str, Any, Any]] = []  # (what, got, want)
        if op in ("all_reduce", "reduce"):
            if op == "all_reduce" or r == 0:
                want = _tile(np, _summed_period(np, dt, [s + 1 for s in range(n)]), self.count)
                expected.append(("result", self.buf, want))
        elif op == "broadcast":
            expected.append(("result", self.buf, _tile(np, _pattern_period(np, dt, 1), self.count)))
        elif op == "all_gather_into_tensor":
            for s in range(n):
                expected.append((f"chunk from rank {s}", self.out[s * c:(s + 1) * c],
                                 _tile(np, _pattern_period(np, dt, 7 * s + 1), c)))
        elif op == "reduce_scatter_tensor":
            period = _summed_period(np, dt, [s + 1 for s in range(n)], phase=(r * c) % PATTERN_PERIOD)
            expected.append(("result", self.out, _tile(np, period, c)))
        else:
            for s in range(n):
                expected.append((f"chunk from rank {s}", self.out[s * c:(s + 1) * c],
                                 _tile(np, _pattern_period(np, dt, self._offsets_a2a(s, r)), c)))
        for what, got, want in expected:
            if not self._same(got, want):
                bad = np.flatnonzero(got != want)
                i = int(bad[0]) if len(bad) else -1
                return (f"rank {r}: {self.op} {what}: {len(bad)} of {len(want)} elements wrong; "
                        f"first at {i}: got {got[i]!r}, expected {want[i]!r}")
        return None

    def zero(self) -> None:
        for name in ("buf", "inp", "out"):
            arr = getattr(self, name, None)
            if arr is not None:
                arr[:] = 0


def measure(case: "Case", call: Callable[[], Any], barrier: Callable[[], Any], iters: int, warmup: int,
            validate: bool, clock: Callable[[], float] = time.perf_counter,
            sync: Callable[[], None] = lambda: None) -> Dict[str, Any]:
    """Validate (once per size: fill, call, check, zero), ``warmup`` untimed calls, a barrier,
    then ``iters`` back-to-back calls: ``{"mean_s": ..., "wrong": None or what is wrong}``.
    ``sync`` makes the host wait for the arrays' work (a GPU's) around the timed region: calls
    on a device return once enqueued."""
    reply: Dict[str, Any] = {}
    if validate:
        case.fill()
        call()
        reply["wrong"] = case.check()
        case.zero()
    for _ in range(warmup):
        call()
    sync()
    barrier()
    sync()
    t0 = clock()
    for _ in range(iters):
        call()
    sync()
    reply["mean_s"] = (clock() - t0) / iters
    return reply
