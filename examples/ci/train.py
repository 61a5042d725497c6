"""A small data-parallel training job: linear regression on synthetic data, each rank on its
shard, gradients averaged with all_reduce, weights checked identical on every rank at the end.

    python train.py --steps 200                  # with torch's env:// variables (RANK, ...)
    distlib-run --nnodes 2:3 ... train.py        # elastic: resumes from --checkpoint after a restart

It is what a user's CI tests with distlib.testing (tests/test_train.py).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket

import numpy as np

import distlib as dist

FEATURES = 16


def shard(rank: int, world: int, rows: int = 256):
    """This rank's slice of a fixed dataset (the same on every rank and every run)."""
    rng = np.random.default_rng(0)
    true_w = rng.normal(size=FEATURES)
    x = rng.normal(size=(rows * 8, FEATURES))
    y = x @ true_w
    part = np.array_split(np.arange(len(x)), world)[rank]
    return x[part], y[part]


def load(path: str | None):
    if path and os.path.exists(path):
        with open(path) as fh:
            saved = json.load(fh)
        return saved["step"], np.array(saved["w"])
    return 0, np.zeros(FEATURES)


def save(path: str | None, step: int, w: np.ndarray) -> None:
    if path:
        tmp = f"{path}.tmp"
        with open(tmp, "w") as fh:
            json.dump({"step": step, "w": w.tolist()}, fh)
        os.replace(tmp, path)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--timeout", type=float, default=30, help="the process group's timeout (s)")
    parser.add_argument("--backend", default=os.environ.get("BACKEND", "gloo"))
    parser.add_argument("--checkpoint", default=None, help="a file every rank can reach (rank 0 writes it)")
    parser.add_argument("--lr", type=float, default=0.05)
    args = parser.parse_args()

    dist.init_process_group(args.backend, timeout=datetime.timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = shard(rank, world)
    start, w = load(args.checkpoint)
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    print(f"train: rank {rank}/{world} on {socket.gethostname()} from step {start} (restart {restart})", flush=True)
    loss = float("nan")
    for step in range(start, args.steps):
        err = x @ w - y
        grad = x.T @ err / len(x)
        dist.all_reduce(grad)
        w -= args.lr * grad / world
        loss = float(np.mean(err ** 2))
        if rank == 0 and step % 20 == 0:
            save(args.checkpoint, step + 1, w)
    check = w.copy()
    dist.broadcast(check, src=0)
    if not np.array_equal(check, w):
        raise RuntimeError(f"rank {rank}: weights differ from rank 0's after {args.steps} steps")
    print(f"train: rank {rank}/{world} done: {args.steps} steps, local loss {loss:.3g}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
