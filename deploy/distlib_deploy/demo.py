"""``make demo`` (``distlib demo``): a TCP master service and 4 local processes that rendezvous
through it and print what they exchanged. No Docker, no torch, a few seconds.

What happens:

1. ``distlib store-server`` starts as a subprocess on a free port of 127.0.0.1 (the master
   service, exactly as the Compose cluster and the Helm chart run it);
2. ``distlib-run --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:<port> --nproc-per-node 4``
   starts 4 workers (this module with ``--worker``), so the launcher is part of the demo;
3. each worker joins through ``env://`` — every rank a client of the master service, its keys
   under the run id — publishes its rank, host and pid, reads everyone else's, and publishes
   what it read; rank 0 checks that all 4 saw all 4 and prints the table;
4. the server is stopped, whatever happened. The exit status is non-zero on any failure.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from datetime import timedelta
from typing import List, Optional

from distlib import settings
from distlib.deadline import Deadline

from distlib import command
from distlib.command import ToolError
from .jobs._common import table
from distlib.store_service import StoreServerProcess

DEFAULT_NPROC = 4


def run_demo(nproc: int = DEFAULT_NPROC, timeout: float = 30.0) -> int:
    deadline = Deadline(timeout)
    started = time.monotonic()
    server = StoreServerProcess("127.0.0.1")
    try:
        server.start(min(10.0, timeout))
    except RuntimeError as exc:
        raise ToolError(f"FAILED: {exc}") from None
    port = server.port
    try:
        run_id = f"demo-{os.getpid()}"
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        env.pop("DISTLIB_INIT_METHOD", None)
        cmd = [sys.executable, "-m", "distlib.run", "--log-level", "WARNING",
               "--nnodes", "1", "--nproc-per-node", str(nproc), "--node-rank", "0",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--run-id", run_id,
               "--rdzv-timeout", "10", "-m", "distlib_deploy.demo", "--worker"]
        print(f"distlib demo: master service (distlib store-server) on 127.0.0.1:{port}; "
              f"starting {nproc} processes with distlib-run (run id {run_id})", flush=True)
        try:
            rc = subprocess.run(cmd, env=env, timeout=deadline.remaining()).returncode
        except subprocess.TimeoutExpired:
            raise ToolError(f"FAILED: the processes did not finish within {timeout:.0f} s") from None
        if rc != 0:
            raise ToolError(f"FAILED (distlib-run exited with {rc})", rc)
        print(f"distlib demo: ok in {time.monotonic() - started:.1f} s", flush=True)
        return 0
    finally:
        server.stop()


# -- the worker side ------------------------------------------------------------------------------


def worker(timeout: float = 20.0) -> int:
    from distlib.rendezvous import rendezvous

    store, rank, world = next(rendezvous("env://", timeout=timedelta(seconds=timeout)))
    me = {"rank": rank, "local_rank": int(os.environ["LOCAL_RANK"]), "host": socket.gethostname(),
          "pid": os.getpid()}
    store.set(f"demo/peer/{rank}", json.dumps(me))
    peers = [json.loads(store.get(f"demo/peer/{r}")) for r in range(world)]
    bad = [p for r, p in enumerate(peers) if p["rank"] != r]
    if bad:
        print(f"rank {rank}: key demo/peer/{bad[0]['rank']} holds the wrong rank: {bad[0]}", file=sys.stderr)
        return 1
    store.set(f"demo/seen/{rank}", json.dumps([p["rank"] for p in peers]))

    if rank != 0:
        return 0
    seen = [json.loads(store.get(f"demo/seen/{r}")) for r in range(world)]
    missing = [r for r, s in enumerate(seen) if s != list(range(world))]
    print(f"{world} processes met through the master service at "
          f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']} (keys under distlib/run/"
          f"{settings.run_id()}/); what each published, and whom it read back:")
    rows = [[r["rank"], r["local_rank"], r["host"], r["pid"], ",".join(map(str, s))] for r, s in zip(peers, seen, strict=False)]
    print(table(["rank", "local", "host", "pid", "ranks it read"], rows), flush=True)
    if missing:
        print(f"ranks {missing} did not read every peer", file=sys.stderr)
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="distlib demo", description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=DEFAULT_NPROC, help="processes (default 4)")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds the whole demo may take (default 30)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    command.add_log_level(parser)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if "log_level" in args:
        command.setup_logging(args.log_level)
    if args.worker:
        return worker()
    return command.run("distlib demo", lambda: run_demo(args.nproc, args.timeout))


if __name__ == "__main__":
    sys.exit(main())
