"""``distlib bench store``: the store layer's throughput and latency, side by side with torch.

Loads (every one against a server in its own process, clients in other processes):

* **single client** — one client process; ops/s of ``set`` (fire-and-forget: the rate
  includes a final ``get`` that drains the server), ``get``, ``add``, ``check``,
  ``compare_set``, ``wait`` on an existing key and ``multi_get`` of 8 keys; 16-byte keys,
  32-byte values, each op timed for ``--seconds``.
* **concurrent clients** — N client processes (default 8, 32, 128) started together, each
  doing set+get pairs on its own keys (16000 pairs in all); aggregate ops/s.
* **barrier** — W simulated ranks (default 1024; ``--barrier-ranks 1024,4096``) each ``add``
  on a counter, the one that reads W sets a done key, all ``wait`` on it. The ranks are W
  TCP connections driven by a few load-generator processes that speak the wire protocol
  themselves (non-blocking sockets, epoll), so the same generator drives distlib's server
  and torch's: the bytes are the ones a torch or distlib client sends. Time from the first
  rank's ADD to the last rank's WAIT reply; connections are made beforehand. Each round
  also splits into its arrival (first ADD to the SET of done) and its release (that SET to
  the last rank through), printed under the table. Within a round the implementations
  alternate iteration by iteration, and the speed-up is also given over those pairs, with
  a 95% bootstrap interval (StoreBench._barrier says why).
* **connect storm** — N threads (default 256) construct a TCPStore client at the same
  instant (distlib clients against distlib's server, torch's against torch's); the time
  until the last one is connected, and the histogram of constructor times.
* **FileStore replay** — a new FileStore client on a file holding K entries (default 10k,
  50k) written by the same implementation: constructor + one ``get``, per entry.
* **security** (only when asked for: ``--sections security``) — distlib against itself:
  connect time, latency and large-value throughput with and without the token and TLS
  (bench/store_security.py).

With torch importable (and no ``--no-torch``), every load runs against torch 2.x too,
interleaved round by round (distlib, torch, distlib, torch ...), and the table shows the
median over rounds of each, the speed-up (how many times better distlib is: ops/s ratio, or
time ratio torch/distlib) and whether the targets below are met.

The targets (which rows carry one, and the bound) are in ``targets.json``, section ``store``.

Machine notes: on small VMs whose idle vCPUs halt, every request/response figure is bimodal
(a cross-CPU wake-up costs ~100 us): compare only figures from the same run. ``--pin 0``
pins every process (servers, clients, generators) to CPU 0, which gives torch its fast mode
consistently (and turns distlib's busy-polling off, see docs/stores.md).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import List, Optional

from distlib import command
from distlib.command import ToolError
from . import store_security
from .children import BenchError
from .results import TORCH, implementations
from .store_measure import DEFAULT_SECTIONS, SECTIONS, StoreBench
from .store_report import finish
from .tables import Printer


def _int_list(text: str) -> List[int]:
    try:
        values = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _sections(text: str) -> List[str]:
    names = [x for x in text.replace(" ", "").split(",") if x]
    bad = [n for n in names if n not in SECTIONS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"sections are {', '.join(SECTIONS)}; got {text!r}")
    return names


def _cpus(text: str) -> List[int]:
    cpus: List[int] = []
    for part in text.split(","):
        if "-" in part:
            lo, hi = part.split("-", 1)
            cpus.extend(range(int(lo), int(hi) + 1))
        elif part:
            cpus.append(int(part))
    if not cpus:
        raise argparse.ArgumentTypeError(f"no CPUs in {text!r}")
    return cpus


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="distlib bench store",
        description="Store benchmark: set/get/add/... ops/s for one and many clients, a W-rank barrier, a "
                    "connect storm and FileStore replay; side by side with torch when it is importable.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--quick", action="store_true",
                   help="a short run (smaller loads, 1 round); explicit options still win")
    command.add_json(p)
    p.add_argument("--no-torch", action="store_true", help="measure distlib only, even if torch is importable")
    p.add_argument("--rounds", type=int, help="rounds per load, interleaved between implementations (default 2; "
                                              "quick 1)")
    p.add_argument("--seconds", type=float, help="measuring time per single-client op (default 1.0; quick 0.1)")
    p.add_argument("--sections", type=_sections, default=list(DEFAULT_SECTIONS),
                   help=f"which loads, comma-separated, of {','.join(SECTIONS)} (default: all but security)")
    p.add_argument("--clients", type=_int_list, help="concurrent client processes (default 8,32,128; quick 4,16)")
    p.add_argument("--pairs", type=int, help="set+get pairs in all, split over the clients (default 16000; "
                                             "quick 800)")
    p.add_argument("--barrier-ranks", type=_int_list, help="simulated ranks W (default 1024; quick 64); e.g. 1024,4096")
    p.add_argument("--barrier-procs", type=int, default=2, help="load-generator processes driving the W ranks")
    p.add_argument("--barrier-iterations", type=int, help="barrier rounds per measurement, median taken (default 10; "
                                                          "quick 2)")
    p.add_argument("--storm-clients", type=int, help="clients of the connect storm (default 256; quick 32)")
    p.add_argument("--storm-timeout", type=float, default=60.0, help="store timeout of each storm client, s")
    p.add_argument("--filestore-keys", type=_int_list, help="entries in the FileStore log (default 10000,50000; "
                                                            "quick 1000)")
    p.add_argument("--filestore-readers", type=int, help="new clients timed per measurement (default 3; quick 1)")
    p.add_argument("--dir", default=None, help="directory for the FileStore files (default: the temp directory)")
    p.add_argument("--torch-backend", choices=("libuv", "legacy"), default="libuv",
                   help="torch's server (and the use_libuv flag of both clients)")
    p.add_argument("--distlib-transport", choices=("auto", "tcp"), default="auto",
                   help="auto: distlib clients reach a distlib server on this host over its UNIX socket "
                        "(what users get); tcp: force TCP, as torch's clients use (DISTLIB_STORE_UNIX=0)")
    p.add_argument("--journal", choices=("off", "turn", "none"), default="off",
                   help="distlib's server with a state directory (a fresh one per load) and this --sync, or "
                        "without (off); docs/stores.md, 'State directory'")
    p.add_argument("--host", default="127.0.0.1", help="address the clients connect to")
    p.add_argument("--security-connects", type=int, help="security: clients constructed per measurement "
                                                          "(default 200; quick 50)")
    p.add_argument("--security-megabytes", type=int, help="security: the large value's size in MiB "
                                                           "(default 4; quick 1)")
    p.add_argument("--tls-cert", help="security: the server's certificate for 127.0.0.1 (default: one made "
                                      "with openssl for the run)")
    p.add_argument("--tls-key", help="security: its key")
    p.add_argument("--tls-ca", help="security: the CA clients verify it with")
    p.add_argument("--pin", type=_cpus, metavar="CPUS",
                   help="pin every process of the benchmark to these CPUs (e.g. 0); default: not pinned")
    p.add_argument("--fail-on-miss", action="store_true", help="exit 1 when a measured target is missed")
    command.add_quiet(p)
    command.add_log_level(p)
    return p


QUICK = dict(rounds=1, seconds=0.1, clients=[4, 16], pairs=800, barrier_ranks=[64], barrier_iterations=2,
             storm_clients=32, filestore_keys=[1000], filestore_readers=1, security_connects=50,
             security_megabytes=1)
FULL = dict(rounds=2, seconds=1.0, clients=[8, 32, 128], pairs=16000, barrier_ranks=[1024], barrier_iterations=10,
            storm_clients=256, filestore_keys=[10000, 50000], filestore_readers=3,
            security_connects=store_security.CONNECTS, security_megabytes=store_security.BIG_BYTES >> 20)


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if "log_level" in args:
        command.setup_logging(args.log_level)
    return command.run("distlib bench store", lambda: _run(args))


def _run(args: argparse.Namespace) -> int:
    for name, value in (QUICK if args.quick else FULL).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.rounds < 1 or args.seconds <= 0:
        raise ToolError("--rounds must be >= 1 and --seconds > 0", 2)
    say = Printer(args.quiet)

    if args.pin:
        os.sched_setaffinity(0, args.pin)  # every child inherits it
    if args.distlib_transport == "tcp":
        os.environ["DISTLIB_STORE_UNIX"] = "0"  # servers and clients, in every child
    impls, torch_version, why_not = implementations(args.no_torch)
    with_torch = TORCH in impls

    bench = StoreBench(args, impls, say)
    started = time.monotonic()
    say(f"distlib bench store: {', '.join(args.sections)}; {args.rounds} round(s); "
        + (f"torch {torch_version} ({args.torch_backend} server)" if with_torch else f"torch not measured ({why_not})"))
    failures: List[str] = []
    for section in SECTIONS:
        if section in args.sections:
            try:
                getattr(bench, section)()
            except BenchError as exc:
                failures.append(f"{section}: {exc}")
                say(f"  {section} FAILED: {exc}")
    wall = time.monotonic() - started
    failures.extend(bench.failures)

    return finish(args, bench, impls, torch_version, why_not, failures, wall)


if __name__ == "__main__":
    sys.exit(main())
