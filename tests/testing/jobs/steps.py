"""A small job for the harness's tests: init, STEPS all_reduces (each sum checked), one line.

Environment: STEPS (20), GROUP_TIMEOUT seconds (20), BACKEND (gloo), INIT_METHOD (env://).
Prints ``steps: rank R/W ok host=<hostname> sum=<last sum>``; an exception ends it (the harness
records it).
"""

import datetime
import os
import socket

import numpy as np

import distlib as dist


def main() -> None:
    backend = os.environ.get("BACKEND", "gloo")
    timeout = datetime.timedelta(seconds=float(os.environ.get("GROUP_TIMEOUT", "20")))
    init = os.environ.get("INIT_METHOD", "env://")
    placement = {} if init.startswith("env://") else {"rank": int(os.environ["RANK"]),
                                                      "world_size": int(os.environ["WORLD_SIZE"])}
    dist.init_process_group(backend, init_method=init, timeout=timeout, **placement)
    rank, world = dist.get_rank(), dist.get_world_size()
    total = 0
    for step in range(int(os.environ.get("STEPS", "20"))):
        values = np.full(8, rank + step, dtype=np.int64)
        dist.all_reduce(values)
        total = int(values[0])
        expected = world * step + world * (world - 1) // 2
        if total != expected:
            raise AssertionError(f"rank {rank}: step {step}: all_reduce gave {total}, expected {expected}")
    print(f"steps: rank {rank}/{world} ok host={socket.gethostname()} sum={total}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
