"""The store benchmark's measurements (bench/store.py describes the loads): ``StoreBench``
runs each section, for every round and implementation a fresh server and fresh client
processes (bench/store_children.py), and fills the rows that bench/store_report.py prints.
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from . import store_security
from .children import FORK, BenchError, Child, run_child
from .results import DISTLIB, TORCH, Row, Target, load_targets
from .store_children import (BarrierRanks, LoadServer, concurrent_client_child, filestore_reader, filestore_writer,
                             single_client_child, storm_child)
from .store_report import StoreReport
from .tables import Printer
from .timing import PairedRatio, histogram, interleaved, median, paired_ratio

SECTIONS = ("single", "concurrent", "barrier", "storm", "filestore", "security")
#: What runs without --sections: the comparison with torch (security is distlib against itself).
DEFAULT_SECTIONS = SECTIONS[:-1]

SINGLE_OPS = (  # (name, label)
    ("set", "set (fire-and-forget)"),
    ("get", "get"),
    ("add", "add"),
    ("check", "check"),
    ("compare_set", "compare_set"),
    ("wait", "wait (key exists)"),
    ("multi_get", "multi_get (8 keys)"),
)
TARGETS = load_targets("store")

STORM_BUCKETS = ((0.010, "<10ms"), (0.100, "10-100ms"), (1.0, "0.1-1s"), (3.0, "1-3s"), (math.inf, ">=3s"))


class StoreBench(StoreReport):
    """The sections of ``distlib bench store``, each a method (``single``, ``concurrent``,
    ``barrier``, ``storm``, ``filestore``, ``security``); the results in ``rows`` and the
    details beside them, printed by StoreReport."""

    def __init__(self, args: argparse.Namespace, impls: Sequence[str], say: Printer):
        self.args = args
        self.impls = list(impls)
        self.say = say
        self.host = args.host
        self.use_libuv = args.torch_backend == "libuv"
        #: distlib's server with a state directory (--journal turn|none) or without (off)
        self.journal = getattr(args, "journal", "off")
        self.rows: List[Row] = []
        self.storm_details: Dict[str, List[Dict[str, Any]]] = {}
        self.transports: Dict[str, str] = {}
        self.failures: List[str] = []
        #: barrier row name -> speed-up from paired iterations (torch time / distlib time)
        self.barrier_pairs: Dict[str, PairedRatio] = {}
        self.security_bench: Optional[store_security.SecurityBench] = None

    def _row(self, section: str, name: str, unit: str, higher: bool, target: Optional[Target] = None,
             note: str = "") -> Row:
        row = Row(section, name, unit, higher, target, note)
        self.rows.append(row)
        return row

    def _rounds(self):
        return interleaved(self.args.rounds, self.impls)

    # each section: for every (round, impl), a fresh server and fresh client processes

    def single(self) -> None:
        targets = TARGETS["single_client"]
        rows = {name: self._row("single client", label, "ops/s", True, targets.get(name)) for name, label in SINGLE_OPS}
        for rnd, impl in self._rounds():
            self.say(f"  single client, round {rnd + 1}, {impl} ...")
            with LoadServer(impl, self.use_libuv, self.journal) as port:
                result = run_child(single_client_child, impl, self.host, port, self.use_libuv, self.args.seconds,
                                   timeout=60 + 20 * self.args.seconds, name=f"{impl}-single-client")
            self.transports[impl] = result["transport"]
            for name, row in rows.items():
                r = result[name]
                row.add(impl, r["ops_s"], p50_us=r["p50_us"], p90_us=r["p90_us"], ops=r["ops"])

    def concurrent(self) -> None:
        largest = max(self.args.clients)
        wanted = TARGETS["concurrent_clients"]
        at = wanted["applies"]["clients"]  # the target's client count, or the largest count above it
        for n in self.args.clients:
            target = wanted["target"] if n == at or (n == largest and n >= at) else None
            row = self._row("concurrent clients", f"{n} client processes, set+get pairs", "ops/s", True, target)
            pairs = max(1, self.args.pairs // n)
            for rnd, impl in self._rounds():
                self.say(f"  {n} concurrent clients, round {rnd + 1}, {impl} ...")
                with LoadServer(impl, self.use_libuv, self.journal) as port:
                    go = FORK.Event()
                    start_at = FORK.Value("d", 0.0, lock=False)
                    kids = []
                    try:
                        for i in range(n):
                            kids.append(Child(concurrent_client_child, impl, self.host, port, self.use_libuv, i, pairs,
                                              go, start_at, name=f"{impl}-client-{i}"))
                        for kid in kids:
                            kid.recv(300)
                        start_at.value = time.perf_counter() + 0.1
                        go.set()
                        results = [kid.result(600) for kid in kids]
                    finally:
                        for kid in kids:
                            kid.stop()
                span = max(r["t1"] for r in results) - min(r["t0"] for r in results)
                ops = sum(r["ops"] for r in results)
                row.add(impl, ops / span, seconds=span, ops=ops, pairs_per_client=pairs)

    def barrier(self) -> None:
        # One server and one set of connected ranks per implementation for all rounds:
        # connecting thousands of ranks to torch's server takes minutes here (it holds a
        # handshake back for ~5 s about every 50 connections, one after the other).
        for world in self.args.barrier_ranks:
            row = self._row("barrier", f"{world} ranks: add, last sets done, all wait", "s", False,
                            TARGETS["barrier"])
            try:
                self._barrier(world, row)
            except BenchError as exc:
                for impl in self.impls:
                    if impl not in row.values or len(row.values[impl]) < self.args.rounds:
                        row.fail(impl, str(exc).splitlines()[0])
                self.failures.append(f"barrier of {world} ranks: {exc}")
                self.say(f"  barrier of {world} ranks FAILED: {exc}")

    def _barrier(self, world: int, row: Row) -> None:
        """Each round runs its iterations with the implementations alternating one by one
        (a b, b a, a b ...), not in blocks: the speed of this load drifts by tens of percent
        within seconds on a small VM, and a block of one implementation's iterations can
        fall in a slow stretch. Each iteration of distlib and the torch iteration next to it
        form a pair; ``barrier_lines`` reports the median ratio of the pairs with a 95%
        bootstrap interval, which says whether a difference is larger than the drift."""
        servers: Dict[str, LoadServer] = {}
        ranks: Dict[str, BarrierRanks] = {}
        try:
            for impl in self.impls:
                servers[impl] = LoadServer(impl, self.use_libuv, self.journal)
                port = servers[impl].__enter__()
                ranks[impl] = BarrierRanks(self.host, port, world, self.args.barrier_procs, impl)
            for impl in self.impls:
                self.say(f"  barrier of {world} ranks: connecting the ranks to {impl}'s server ...")
                ranks[impl].wait_ready(180 + world * 0.5)
            every: Dict[str, List[float]] = {impl: [] for impl in self.impls}
            for rnd in range(self.args.rounds):
                self.say(f"  barrier of {world} ranks, round {rnd + 1}: {self.args.barrier_iterations} iterations"
                         + (f", {' and '.join(self.impls)} alternating" if len(self.impls) > 1 else "") + " ...")
                times: Dict[str, List[float]] = {impl: [] for impl in self.impls}
                phases: Dict[str, List[Tuple[float, float]]] = {impl: [] for impl in self.impls}
                for it in range(self.args.barrier_iterations):
                    for impl in self.impls if it % 2 == 0 else self.impls[::-1]:
                        times[impl] += ranks[impl].run(1)
                        phases[impl] += ranks[impl].phases
                for impl in self.impls:
                    t, ph = times[impl], phases[impl]
                    every[impl] += t
                    row.add(impl, median(t), iterations=[round(x, 6) for x in t],
                            arrival_s=median([a for a, _ in ph]), release_s=median([r for _, r in ph]))
            if TORCH in every:
                self.barrier_pairs[row.name] = paired_ratio(every[TORCH], every[DISTLIB])
        finally:
            for impl in ranks:
                ranks[impl].stop()
            for impl in servers:
                servers[impl].__exit__()

    def storm(self) -> None:
        n = self.args.storm_clients
        wanted = TARGETS["connect_storm"]
        target = wanted["target"] if n >= wanted["applies"]["min_clients"] else None
        row = self._row("connect storm", f"{n} clients connect at once: last one in", "s", False, target)
        for rnd, impl in self._rounds():
            self.say(f"  connect storm of {n} clients, round {rnd + 1}, {impl} ...")
            with LoadServer(impl, self.use_libuv, self.journal) as port:
                result = run_child(storm_child, impl, self.host, port, self.use_libuv, n, self.args.storm_timeout,
                                   timeout=self.args.storm_timeout + 120, name=f"{impl}-storm")
            durations = result["durations"]
            hist = histogram(durations, STORM_BUCKETS)
            detail = {"max_s": max(durations) if durations else None, "median_s": median(durations),
                      "histogram": hist, "failed": result["failed"], "errors": result["errors"]}
            self.storm_details.setdefault(impl, []).append(detail)
            if result["all_connected_s"] is None:
                row.fail(impl, f"{result['failed']} of {n} clients failed: {result['errors'][:1]}")
            else:
                row.add(impl, result["all_connected_s"], **detail)

    def filestore(self) -> None:
        directory = tempfile.mkdtemp(prefix="distlib-bench-filestore-", dir=self.args.dir)
        try:
            for keys in self.args.filestore_keys:
                row = self._row("FileStore", f"new client replays {keys:,} entries", "us/entry", False,
                                TARGETS["filestore_replay"])
                for rnd, impl in self._rounds():
                    self.say(f"  FileStore replay of {keys} entries, round {rnd + 1}, {impl} ...")
                    path = os.path.join(directory, f"{impl}-{keys}-{rnd}")
                    with Child(filestore_writer, impl, path, keys, name=f"{impl}-filestore-writer") as writer:
                        writer.recv(600)
                        times = [run_child(filestore_reader, impl, path, keys, timeout=300,
                                           name=f"{impl}-filestore-reader") for _ in range(self.args.filestore_readers)]
                    for suffix in ("", ".distlib-live"):
                        try:
                            os.unlink(path + suffix)
                        except OSError:
                            pass
                    row.add(impl, median(times) / keys * 1e6, reader_seconds=[round(t, 6) for t in times])
        finally:
            try:
                for name in os.listdir(directory):
                    os.unlink(os.path.join(directory, name))
                os.rmdir(directory)
            except OSError:
                pass

    def security(self) -> None:
        try:
            files = store_security.files_from_args(self.args.tls_cert, self.args.tls_key, self.args.tls_ca)
        except ValueError as exc:
            raise BenchError(str(exc)) from None
        bench = store_security.SecurityBench(self.args.rounds, self.args.seconds, self.say, files,
                                             connects=self.args.security_connects,
                                             big=self.args.security_megabytes * 1024 * 1024)
        self.security_bench = bench
        bench.run()
