"""``make demo`` (``python -m distlib.demo``): a TCP master service and 4 local processes that
rendezvous through it and print what they exchanged. No Docker, no torch, a few seconds.

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

from .deadline import Deadline

DEFAULT_NPROC = 4


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _start_server(deadline: Deadline) -> "tuple[subprocess.Popen, int]":
    """A ``distlib store-server`` on a free port; retried when the port was taken meanwhile."""
    from .errors import DistError
    from .launcher.master import check_answers

    last = ""
    for _attempt in range(3):
        port = _free_port()
        # stderr inherited: the server logs warnings and errors only (e.g. why it could not start)
        proc = subprocess.Popen(
            [sys.executable, "-m", "distlib.cli", "--log-level", "WARNING", "store-server",
             "--host", "127.0.0.1", "--port", str(port), "--log-level", "WARNING"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        while not deadline.expired():
            if proc.poll() is not None:
                last = f"it exited with {proc.returncode}"
                break
            try:
                check_answers("127.0.0.1", port, min(0.5, max(0.05, deadline.remaining())))
                return proc, port
            except (DistError, OSError) as exc:  # not up yet; the deadline bounds this loop
                last = str(exc)
        else:
            _stop(proc)
            raise RuntimeError(f"the store server on port {port} did not answer within "
                               f"{deadline.seconds:.0f} s: {last}")
    raise RuntimeError(f"could not start a store server: {last}")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def run_demo(nproc: int = DEFAULT_NPROC, timeout: float = 30.0) -> int:
    deadline = Deadline(timeout)
    started = time.monotonic()
    server, port = _start_server(Deadline(min(10.0, timeout)))
    try:
        run_id = f"demo-{os.getpid()}"
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        env.pop("DISTLIB_INIT_METHOD", None)
        cmd = [sys.executable, "-m", "distlib.run", "--log-level", "WARNING",
               "--nnodes", "1", "--nproc-per-node", str(nproc), "--node-rank", "0",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--run-id", run_id,
               "--rdzv-timeout", "10", "-m", "distlib.demo", "--worker"]
        print(f"distlib demo: master service (distlib store-server) on 127.0.0.1:{port}; "
              f"starting {nproc} processes with distlib-run (run id {run_id})", flush=True)
        try:
            rc = subprocess.run(cmd, env=env, timeout=deadline.remaining()).returncode
        except subprocess.TimeoutExpired:
            print(f"distlib demo: FAILED: the processes did not finish within {timeout:.0f} s", file=sys.stderr)
            return 1
        if rc != 0:
            print(f"distlib demo: FAILED (distlib-run exited with {rc})", file=sys.stderr)
        else:
            print(f"distlib demo: ok in {time.monotonic() - started:.1f} s", flush=True)
        return rc
    finally:
        _stop(server)


# -- the worker side ------------------------------------------------------------------------------


def _table(rows: List[dict], seen: List[List[int]]) -> str:
    header = ["rank", "local", "host", "pid", "ranks it read"]
    body = [[str(r["rank"]), str(r["local_rank"]), r["host"], str(r["pid"]), ",".join(map(str, s))]
            for r, s in zip(rows, seen)]
    widths = [max(len(x) for x in col) for col in zip(header, *body)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = [fmt.format(*header), fmt.format(*("-" * w for w in widths))] + [fmt.format(*b) for b in body]
    return "\n".join(line.rstrip() for line in lines)


def worker(timeout: float = 20.0) -> int:
    from .rendezvous import rendezvous

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

    # -- When collectives exist: init_process_group over this store and an all_reduce of each
    # -- rank's value here; rank 0 will print the sum next to the table.

    if rank != 0:
        return 0
    seen = [json.loads(store.get(f"demo/seen/{r}")) for r in range(world)]
    missing = [r for r, s in enumerate(seen) if s != list(range(world))]
    print(f"{world} processes met through the master service at "
          f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']} (keys under distlib/run/"
          f"{os.environ.get('DISTLIB_RUN_ID', '')}/); what each published, and whom it read back:")
    print(_table(peers, seen), flush=True)
    if missing:
        print(f"ranks {missing} did not read every peer", file=sys.stderr)
        return 1
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m distlib.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=DEFAULT_NPROC, help="processes (default 4)")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds the whole demo may take (default 30)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker()
    try:
        return run_demo(args.nproc, args.timeout)
    except RuntimeError as exc:
        print(f"distlib demo: FAILED: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
