"""The nccl backend's per-call cost on the host, on the FAKE device (fake_cuda.py): what the
Python side of one 8-byte all_reduce costs with ``depth`` operations in flight. Not a GPU
figure (the fake's own calls stand in for cupy's and NCCL's); it shows whether the backend's
cost depends on the queue, which on a GPU is ``distlib bench collectives --device cuda``'s
depth rows. A measurement, never a test:

    python -m tests.gpu.fake_call_cost --depth 10 --depth 10000 --rounds 5

A burst holds the fake device, issues ``depth`` synchronous all_reduces (each returns once
enqueued, so all are in flight) and times them, then releases the device and waits until the
watchdog has settled them. A round is enough bursts for 10,000 timed calls at every depth (so
that a loaded machine weighs on each depth alike); per call = timed time / calls; the median
of the rounds is printed. ``--back-to-back N``: N calls with the device running, as the
issue's first figure (3,000 on an H200). ``--settle-s``: how long to wait for a burst to be
settled (a slow watchdog's backlog would otherwise weigh on the next burst).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from datetime import timedelta

import numpy as np


def _settle(backend, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while backend.watchdog.outstanding() and time.monotonic() < deadline:
        time.sleep(0.01)
    return not backend.watchdog.outstanding()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depth", type=int, action="append", default=[])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--back-to-back", type=int, default=0)
    parser.add_argument("--settle-s", type=float, default=120.0)
    args = parser.parse_args(argv)
    from distlib.testing.fake_gpu import cuda as fake_cuda

    fake_cuda.install()
    import distlib as dist

    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=600),
                            device_id=0)
    backend = dist.distributed.get_default_group().backends["cuda"]
    x = fake_cuda.cupy.asarray(np.ones(2, np.float32))  # 8 bytes
    for _ in range(200):
        dist.all_reduce(x)
    _settle(backend, args.settle_s)
    rows = []
    if args.back_to_back:
        times = []
        for _ in range(args.rounds):
            started = time.perf_counter()
            for _ in range(args.back_to_back):
                dist.all_reduce(x)
            fake_cuda.Device(0).synchronize()
            times.append((time.perf_counter() - started) / args.back_to_back)
            if not _settle(backend, args.settle_s):
                print(f"the watchdog did not settle the round within {args.settle_s} s", file=sys.stderr)
                break
        rows.append((f"back to back, {args.back_to_back} calls", times))
    for depth in args.depth:
        times = []
        bursts = max(1, 10_000 // depth)
        for _ in range(args.rounds):
            took = 0.0
            for _ in range(bursts):
                release = fake_cuda.hold()
                started = time.perf_counter()
                for _ in range(depth):
                    dist.all_reduce(x)
                took += time.perf_counter() - started
                release.set()
                if not _settle(backend, args.settle_s):
                    print(f"depth {depth}: the watchdog did not settle {depth} operations within {args.settle_s} s",
                          file=sys.stderr)
                    break
            times.append(took / (bursts * depth))
        rows.append((f"{depth} in flight", times))
    for label, times in rows:
        print(f"{label:>28}: {statistics.median(times) * 1e6:8.1f} us per call (median of {len(times)}: "
              f"{', '.join(f'{t * 1e6:.1f}' for t in times)})")
    sys.stdout.flush()
    os._exit(0)  # the watchdog of a slow backend may still be busy: do not wait for it


if __name__ == "__main__":
    sys.exit(main())
