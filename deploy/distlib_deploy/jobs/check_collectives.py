"""Rendezvous, then one all_reduce and one all_gather whose results are checked: one line per
rank that a test (or a person) can verify. Used by the container tests for every init method.

    python -m distlib_deploy.jobs.check_collectives [--init-method URL] [--timeout S]
                                             [--large-mib N --iterations K]

The init method: ``--init-method``, else ``DISTLIB_INIT_METHOD``, else ``env://``; rank and
world size from ``RANK``/``WORLD_SIZE`` when the URL has none. On success each rank prints

    check_collectives: rank R/W OK all_reduce=<sum> all_gather=<r0,r1,...> host=<host> address=<ip:port> init=<s>

where all_reduce is the sum over the elements of ``arange(16) + rank`` summed over ranks and
all_gather lists the rank each gathered block came from. With ``--large-mib N`` it then runs
``--iterations`` all_reduces of N MiB, printing ``check_collectives: rank R large all_reduce
i/K`` before each (the fault tests kill or cut off a container during them). Any failure
prints ``check_collectives: rank R FAILED after <s> s: <ErrorType>: <message>`` and exits 1.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import sys
import time
from datetime import timedelta
from typing import List, Optional

import numpy as np

from .. import settings as deploy_settings
from . import _common as C


def expected_sum(world: int, n: int = 16) -> int:
    return int(world * n * (n - 1) // 2 + n * world * (world - 1) // 2)


def run(args: argparse.Namespace, phase: List[float]) -> int:
    import distlib as dist

    url = args.init_method or C.init_method_from_env()
    match = re.search(r"[?&]rank=(\d+)", url)
    if match:
        os.environ.setdefault("RANK", match.group(1))  # for the FAILED line
    rank = world = -1
    if url.startswith("file://"):
        url, rank, world = C.prepare_file_url(url)
    elif url.startswith("tcp://") and "rank=" not in url:
        rank = C.env_int_or("RANK", -1)
        world = C.env_int_or("WORLD_SIZE", -1)
    t0 = time.monotonic()
    phase[0] = t0
    dist.init_process_group(deploy_settings.job_backend(), init_method=url,
                            timeout=timedelta(seconds=args.timeout), rank=rank, world_size=world)
    init_s = time.monotonic() - t0
    rank, world = dist.get_rank(), dist.get_world_size()

    phase[0] = time.monotonic()
    x = np.arange(16, dtype=np.int64) + rank
    dist.all_reduce(x)
    want = world * np.arange(16, dtype=np.int64) + world * (world - 1) // 2
    if not np.array_equal(x, want):
        raise RuntimeError(f"all_reduce gave {x.tolist()}, expected {want.tolist()}")
    blocks = [np.empty(4, np.int64) for _ in range(world)]
    dist.all_gather(blocks, np.full(4, rank, np.int64))
    sources = []
    for k, block in enumerate(blocks):
        if not np.all(block == k):
            raise RuntimeError(f"all_gather block {k} holds {block.tolist()}, expected {k}s")
        sources.append(int(block[0]))
    address = C.advertised_address(rank) or "?"
    C.say(f"check_collectives: rank {rank}/{world} OK all_reduce={int(x.sum())} "
          f"all_gather={','.join(map(str, sources))} host={socket.gethostname()} address={address} "
          f"init={init_s:.2f}")

    if args.large_mib:
        count = int(args.large_mib * (1 << 20)) // 4
        big = np.ones(count, np.float32)
        for i in range(1, args.iterations + 1):
            C.say(f"check_collectives: rank {rank} large all_reduce {i}/{args.iterations}")
            phase[0] = time.monotonic()
            big.fill(1.0)
            dist.all_reduce(big)
            if big[0] != world or big[-1] != world:
                raise RuntimeError(f"large all_reduce {i} gave {big[0]}, expected {world}")
    phase[0] = time.monotonic()
    dist.barrier()
    dist.destroy_process_group()
    C.say(f"check_collectives: rank {rank} done")
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m distlib_deploy.jobs.check_collectives",
                                description=__doc__.splitlines()[0])
    p.add_argument("--init-method", default=None, help="URL (default: DISTLIB_INIT_METHOD, else env://)")
    p.add_argument("--timeout", type=float, default=60.0, help="process-group timeout, seconds (default 60)")
    p.add_argument("--large-mib", type=float, default=0.0, help="then all_reduce this many MiB, repeatedly")
    p.add_argument("--iterations", type=int, default=20, help="how many large all_reduces (default 20)")
    args = p.parse_args(argv)
    phase = [time.monotonic()]
    try:
        return run(args, phase)
    except Exception as exc:  # noqa: BLE001 - the line the tests read
        C.say(f"check_collectives: rank {os.environ.get('RANK', '?')} FAILED after "
              f"{time.monotonic() - phase[0]:.1f} s: {C.error_name(exc)}: {exc}", sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
