"""A ``backend="nccl"`` job on cupy arrays, for the harness's fake-GPU test: on a CPU runner the
harness puts its fake device under it (``fake_gpus=1``: ``import cupy`` gets the fake). STEPS
all_reduces and a broadcast, each checked; one line at the end.
"""

import datetime
import os
import socket

import cupy
import numpy as np

import distlib as dist


def main() -> None:
    dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=float(os.environ.get("GROUP_TIMEOUT", "20"))))
    rank, world = dist.get_rank(), dist.get_world_size()
    total = 0.0
    for step in range(int(os.environ.get("STEPS", "10"))):
        values = cupy.asarray(np.full(1024, rank + step, dtype=np.float32))
        dist.all_reduce(values)
        total = float(values.get()[0])
        if total != world * step + world * (world - 1) / 2 and not os.environ.get("NO_CHECK"):
            raise AssertionError(f"rank {rank}: step {step}: all_reduce gave {total}")
    weights = cupy.asarray(np.arange(16, dtype=np.float64) * (rank + 1))
    dist.broadcast(weights, src=world - 1)
    if not np.array_equal(weights.get(), np.arange(16) * world):
        raise AssertionError(f"rank {rank}: broadcast gave {weights.get()}")
    print(f"nccl_steps: rank {rank}/{world} ok host={socket.gethostname()} sum={total:g} "
          f"device={type(values).__module__}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
