"""A torch.distributed job for the harness's interop test: init through env:// (the harness's
master service: TORCHELASTIC_USE_AGENT_STORE=True), STEPS all_reduces of a CPU tensor (each sum
checked), one line per step and one at the end.

Environment: STEPS (20), GROUP_TIMEOUT seconds (20).
"""

import datetime
import os
import socket

import torch
import torch.distributed as dist


def main() -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=float(os.environ.get("GROUP_TIMEOUT", "20"))))
    rank, world = dist.get_rank(), dist.get_world_size()
    total = 0
    for step in range(int(os.environ.get("STEPS", "20"))):
        values = torch.full((8,), rank + step, dtype=torch.int64)
        dist.all_reduce(values)
        total = int(values[0])
        if total != world * step + world * (world - 1) // 2:
            raise AssertionError(f"rank {rank}: step {step}: all_reduce gave {total}")
        print(f"torch_steps: rank {rank} step {step}", flush=True)
    print(f"torch_steps: rank {rank}/{world} ok host={socket.gethostname()} sum={total}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
