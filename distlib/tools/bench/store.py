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
import math
import os
import select
import socket
import sys
import tempfile
import threading
import time
from datetime import timedelta
from typing import Any, Dict, List, Optional, Sequence, Tuple

from distlib.net import raise_fd_limit

from ..store_service import StoreServerProcess
from .. import command
from ..command import ToolError
from . import common, store_security
from .common import (
    _CTX,
    BenchError,
    Child,
    Printer,
    Row,
    Table,
    Target,
    fmt_seconds,
    fmt_speedup,
    fmt_value,
    histogram,
    median,
    run_child,
    sleep_until,
    timed_loop,
)

DISTLIB, TORCH = common.DISTLIB, common.TORCH
SECTIONS = ("single", "concurrent", "barrier", "storm", "filestore", "security")
#: What runs without --sections: the comparison with torch (security is distlib against itself).
DEFAULT_SECTIONS = SECTIONS[:-1]

KEY_BYTES = 16
VALUE = b"v" * 32

SINGLE_OPS = (  # (name, label)
    ("set", "set (fire-and-forget)"),
    ("get", "get"),
    ("add", "add"),
    ("check", "check"),
    ("compare_set", "compare_set"),
    ("wait", "wait (key exists)"),
    ("multi_get", "multi_get (8 keys)"),
)
TARGETS = common.load_targets("store")

STORM_BUCKETS = ((0.010, "<10ms"), (0.100, "10-100ms"), (1.0, "0.1-1s"), (3.0, "1-3s"), (math.inf, ">=3s"))


def _key(prefix: str, i: int) -> str:
    """A 16-byte key (as in torch's reference measurements): prefix, then zero-padded i."""
    return prefix + str(i).zfill(max(1, KEY_BYTES - len(prefix)))


# -- implementations: what runs inside the children -----------------------------------------------


def _tcp_client(impl: str, host: str, port: int, use_libuv: bool, timeout: float = 120.0):
    if impl == TORCH:
        import torch.distributed as tdist

        return tdist.TCPStore(host, port, None, False, timedelta(seconds=timeout), use_libuv=use_libuv)
    from distlib.store import TCPStore

    return TCPStore(host, port, None, False, timedelta(seconds=timeout), use_libuv=use_libuv)


def _file_store(impl: str, path: str):
    if impl == TORCH:
        import torch.distributed as tdist

        return tdist.FileStore(path, -1)
    from distlib.store import FileStore

    return FileStore(path, -1)


def _wait_for_stop(conn) -> None:
    try:
        while conn.recv()[0] != "stop":
            pass
    except (EOFError, OSError):
        pass


def _torch_server_child(conn, use_libuv: bool) -> None:
    """torch's TCPStore server alone in this process; sends ("port", p), serves until "stop"."""
    import torch.distributed as tdist

    raise_fd_limit()
    master = tdist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=600),
                            wait_for_workers=False, use_libuv=use_libuv)
    conn.send(("port", master.port))
    _wait_for_stop(conn)


class _Server:
    """A server in its own process for one load; ``with _Server(...) as port:``. distlib's is
    ``distlib store-server`` (listening on every interface), as a deployment runs it; torch's a
    TCPStore master in a forked child."""

    def __init__(self, impl: str, use_libuv: bool):
        self.impl = impl
        if impl == TORCH:
            self.child = Child(_torch_server_child, use_libuv, name="torch-store-server")
        else:
            self.service = StoreServerProcess("127.0.0.1", listen_host="0.0.0.0")

    def __enter__(self) -> int:
        if self.impl != TORCH:
            try:
                return self.service.start(120).port
            except RuntimeError as exc:
                raise BenchError(str(exc)) from None
        try:
            return self.child.recv(120)
        except BaseException:
            self.child.stop()
            raise

    def __exit__(self, *exc_info) -> None:
        if self.impl == TORCH:
            self.child.stop()
        else:
            self.service.stop()


def _single_child(conn, impl: str, host: str, port: int, use_libuv: bool, seconds: float) -> Dict[str, Any]:
    store = _tcp_client(impl, host, port, use_libuv)
    keys = [_key("k", i) for i in range(1024)]
    key, counter = keys[0], _key("counter", 0)
    keys8 = keys[:8]
    for k in keys:
        store.set(k, VALUE)
    loads = {
        "set": lambda i: store.set(keys[i & 1023], VALUE),
        "get": lambda i: store.get(key),
        "add": lambda i: store.add(counter, 1),
        "check": lambda i: store.check([key]),
        "compare_set": lambda i: store.compare_set(key, VALUE, VALUE),
        "wait": lambda i: store.wait([key]),
        "multi_get": lambda i: store.multi_get(keys8),
    }
    out: Dict[str, Any] = {"transport": getattr(store, "transport", "tcp")}
    for name, fn in loads.items():
        timed_loop(fn, min(0.05, seconds / 4), record=False)  # warm up (and settle spin state)
        store.get(key)
        result = timed_loop(fn, seconds)
        elapsed = result.seconds
        if name == "set":  # fire-and-forget: count the time the server needs to catch up
            t0 = time.perf_counter()
            store.get(keys[(result.ops - 1) & 1023])
            elapsed += time.perf_counter() - t0
        out[name] = {
            "ops_s": result.ops / elapsed, "ops": result.ops, "seconds": elapsed,
            "p50_us": result.latency_quantile(0.5) * 1e6, "p90_us": result.latency_quantile(0.9) * 1e6,
        }
    return out


def _concurrent_child(conn, impl: str, host: str, port: int, use_libuv: bool, index: int,
                      pairs: int, go, start_at) -> Dict[str, float]:
    store = _tcp_client(impl, host, port, use_libuv)
    keys = [_key(f"c{index}.", j) for j in range(8)]
    for k in keys:  # warm up, untimed: a fresh fork pays copy-on-write faults on first use
        store.set(k, VALUE)
        store.get(k)
    conn.send(("ready",))
    if not go.wait(300):
        raise BenchError("no start signal within 300 s")
    sleep_until(start_at.value)
    set_, get = store.set, store.get
    t0 = time.perf_counter()
    for i in range(pairs):
        k = keys[i & 7]
        set_(k, VALUE)
        get(k)
    t1 = time.perf_counter()
    return {"t0": t0, "t1": t1, "ops": 2 * pairs}


# -- the barrier load generator: W ranks as raw protocol connections ------------------------------


def _barrier_generator(conn, host: str, port: int, ranks: Sequence[int], world: int) -> Dict[str, Any]:
    """Drive ``ranks`` (a slice of the W simulated ranks) through barrier rounds.

    Setup: one connection per rank, each through the handshake torch's clients do
    (VALIDATE, PING with a nonce, read the echo), all in flight at once (torch's servers
    hold a handshake back for 5 s now and then; done one by one, 1024 ranks would take
    minutes to connect). Then, per ("round", r, start_at): at
    ``start_at`` every rank sends ``ADD /bench/barrier/<r>/arrive 1``; the rank whose reply
    is W sends ``SET /bench/barrier/<r>/done 1``; each rank then sends ``WAIT [done]`` and
    is through when its ``00`` arrives. Reports (first ADD sent, last WAIT answered, SET
    sent or None if none of its ranks read W), so that a round splits into its arrival
    (first ADD to SET) and its release (SET to the last rank through).
    """
    from distlib.store.tcp import codec as proto

    raise_fd_limit()
    socks: List[socket.socket] = []
    for rank in ranks:
        sock = socket.create_connection((host, port), timeout=60)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(proto.validate() + proto.ping(rank))
        sock.setblocking(False)
        socks.append(sock)
    index = {s.fileno(): i for i, s in enumerate(socks)}
    ep = select.epoll(len(socks) + 1)
    for s in socks:
        ep.register(s.fileno(), select.EPOLLIN)
    echoes = [b""] * len(socks)
    waiting = len(socks)
    limit = 120 + 0.25 * world  # torch's servers take ~0.1 s per connection here (see barrier())
    deadline = time.monotonic() + limit
    while waiting:
        events = ep.poll(max(0.0, deadline - time.monotonic()))
        if not events:
            raise BenchError(f"{waiting} of {len(socks)} ranks got no PING echo within {limit:.0f} s")
        for fd, _ in events:
            i = index[fd]
            data = socks[i].recv(4 - len(echoes[i]))
            if not data:
                raise BenchError("the server closed a rank's connection during the handshake")
            echoes[i] += data
            if len(echoes[i]) == 4:
                if proto.U32.unpack(echoes[i])[0] != ranks[i] & 0xFFFFFFFF:
                    raise BenchError("wrong PING echo")
                waiting -= 1
                ep.modify(fd, 0)  # nothing more until the rounds start
    for s in socks:
        ep.modify(s.fileno(), select.EPOLLIN)
    conn.send(("ready", len(socks)))
    n = len(socks)
    i64 = proto.I64.unpack_from
    rounds = 0
    while True:
        msg = conn.recv()
        if msg[0] == "stop":
            break
        _, round_id, start_at = msg
        base = f"/bench/barrier/{round_id}/".encode()
        add_req = proto.add(base + b"arrive", 1)
        wait_req = proto.keys_request(proto.Op.WAIT, [base + b"done"])
        last_req = proto.set_(base + b"done", b"1") + wait_req
        state = [0] * n
        bufs = [b""] * n
        remaining = n
        t_set = None
        sleep_until(start_at)
        t_first = time.perf_counter()
        for s in socks:
            s.send(add_req)  # 30 bytes on an idle connection: the kernel takes them whole
        t_last = t_first
        while remaining:
            events = ep.poll(60)
            if not events:
                raise BenchError(f"barrier round {round_id}: {remaining} of {n} ranks got no reply within 60 s")
            for fd, _ in events:
                i = index[fd]
                data = socks[i].recv(64)
                if not data:
                    raise BenchError("the server closed a rank's connection")
                buf = bufs[i] + data
                if state[i] == 0 and len(buf) >= 8:
                    value = i64(buf)[0]
                    buf = buf[8:]
                    state[i] = 1
                    if value == world:
                        t_set = time.perf_counter()
                        socks[i].send(last_req)
                    else:
                        socks[i].send(wait_req)
                if state[i] == 1 and buf:
                    if buf[0] != 0:
                        raise BenchError(f"WAIT answered {buf[0]}, not STOP_WAITING")
                    buf = buf[1:]
                    state[i] = 2
                    remaining -= 1
                    t_last = time.perf_counter()
                bufs[i] = buf
        rounds += 1
        conn.send(("round", t_first, t_last, t_set))
    for s in socks:
        s.close()
    return {"rounds": rounds}


class _BarrierRanks:
    """W simulated ranks connected to one server: ``procs`` generator children."""

    def __init__(self, host: str, port: int, world: int, procs: int, tag: str):
        procs = max(1, min(procs, world))
        self.gens = [Child(_barrier_generator, host, port, list(range(g, world, procs)), world,
                           name=f"{tag}-barrier-generator-{g}") for g in range(procs)]
        self.rounds = 0
        #: per iteration of the last run(): (arrival, release) in seconds; arrival is first
        #: ADD sent to SET sent, release is SET sent to the last rank through
        self.phases: List[Tuple[float, float]] = []

    def wait_ready(self, timeout: float) -> None:
        for g in self.gens:
            g.recv(timeout)

    def run(self, iterations: int) -> List[float]:
        """Times (s) of ``iterations`` barrier rounds, each on fresh keys."""
        times = []
        self.phases = []
        for _ in range(iterations):
            start_at = time.perf_counter() + 0.05
            for g in self.gens:
                g.send(("round", self.rounds, start_at))
            reports = [g.recv(180) for g in self.gens]
            self.rounds += 1
            first, last = min(r[0] for r in reports), max(r[1] for r in reports)
            times.append(last - first)
            t_set = next(r[2] for r in reports if r[2] is not None)
            self.phases.append((t_set - first, last - t_set))
        return times

    def stop(self) -> None:
        for g in self.gens:
            g.stop()


# -- connect storm ------------------------------------------------------------------------------


def _storm_child(conn, impl: str, host: str, port: int, use_libuv: bool, clients: int,
                 timeout: float) -> Dict[str, Any]:
    raise_fd_limit()
    make = _tcp_client
    if impl == TORCH:
        import torch.distributed  # noqa: F401 - imported before the clock starts
    else:
        from distlib.store import TCPStore  # noqa: F401
    gate = threading.Barrier(clients + 1)
    times: List[Optional[tuple]] = [None] * clients
    stores: List[Any] = [None] * clients

    def connect(i: int) -> None:
        gate.wait()
        t0 = time.perf_counter()
        try:
            stores[i] = make(impl, host, port, use_libuv, timeout)
            times[i] = (t0, time.perf_counter(), None)
        except Exception as exc:  # noqa: BLE001 - reported as a failed client
            times[i] = (t0, time.perf_counter(), f"{type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=connect, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    gate.wait()
    t_go = time.perf_counter()
    for t in threads:
        t.join(timeout + 60)
    done = [t for t in times if t is not None]
    errors = [t[2] for t in done if t[2]]
    ok = [t for t in done if not t[2]]
    return {
        "durations": [t[1] - t[0] for t in ok],
        "all_connected_s": (max(t[1] for t in ok) - t_go) if ok and not errors and len(done) == clients else None,
        "errors": errors[:5], "failed": len(errors) + (clients - len(done)),
    }


# -- FileStore replay ---------------------------------------------------------------------------


def _filestore_writer(conn, impl: str, path: str, keys: int) -> None:
    store = _file_store(impl, path)
    for i in range(keys):
        store.set(_key("f", i), VALUE)
    store.get(_key("f", keys - 1))
    conn.send(("ready",))
    _wait_for_stop(conn)
    del store


def _filestore_reader(conn, impl: str, path: str, keys: int) -> float:
    t0 = time.perf_counter()
    store = _file_store(impl, path)
    value = store.get(_key("f", keys - 1))
    elapsed = time.perf_counter() - t0
    if value != VALUE:
        raise BenchError(f"read back {value!r}")
    del store
    return elapsed


# -- the benchmark ------------------------------------------------------------------------------


class StoreBench:
    def __init__(self, args: argparse.Namespace, impls: Sequence[str], say: Printer):
        self.args = args
        self.impls = list(impls)
        self.say = say
        self.host = args.host
        self.use_libuv = args.torch_backend == "libuv"
        self.rows: List[Row] = []
        self.storm_details: Dict[str, List[Dict[str, Any]]] = {}
        self.transports: Dict[str, str] = {}
        self.failures: List[str] = []
        #: barrier row name -> speed-up from paired iterations (torch time / distlib time)
        self.barrier_pairs: Dict[str, common.PairedRatio] = {}
        self.security_bench: Optional[store_security.SecurityBench] = None

    def _row(self, section: str, name: str, unit: str, higher: bool, target: Optional[Target] = None,
             note: str = "") -> Row:
        row = Row(section, name, unit, higher, target, note)
        self.rows.append(row)
        return row

    def _rounds(self):
        return common.interleaved(self.args.rounds, self.impls)

    # each section: for every (round, impl), a fresh server and fresh client processes

    def single(self) -> None:
        targets = TARGETS["single_client"]
        rows = {name: self._row("single client", label, "ops/s", True, targets.get(name)) for name, label in SINGLE_OPS}
        for rnd, impl in self._rounds():
            self.say(f"  single client, round {rnd + 1}, {impl} ...")
            with _Server(impl, self.use_libuv) as port:
                result = run_child(_single_child, impl, self.host, port, self.use_libuv, self.args.seconds,
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
                with _Server(impl, self.use_libuv) as port:
                    go = _CTX.Event()
                    start_at = _CTX.Value("d", 0.0, lock=False)
                    kids = []
                    try:
                        for i in range(n):
                            kids.append(Child(_concurrent_child, impl, self.host, port, self.use_libuv, i, pairs,
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
        servers: Dict[str, _Server] = {}
        ranks: Dict[str, _BarrierRanks] = {}
        try:
            for impl in self.impls:
                servers[impl] = _Server(impl, self.use_libuv)
                port = servers[impl].__enter__()
                ranks[impl] = _BarrierRanks(self.host, port, world, self.args.barrier_procs, impl)
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
                self.barrier_pairs[row.name] = common.paired_ratio(every[TORCH], every[DISTLIB])
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
            with _Server(impl, self.use_libuv) as port:
                result = run_child(_storm_child, impl, self.host, port, self.use_libuv, n, self.args.storm_timeout,
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
                    with Child(_filestore_writer, impl, path, keys, name=f"{impl}-filestore-writer") as writer:
                        writer.recv(600)
                        times = [run_child(_filestore_reader, impl, path, keys, timeout=300,
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

    # -- output --------------------------------------------------------------------------------

    def table(self) -> str:
        has_ref = TORCH in self.impls
        headers = ["load", "unit", "distlib"] + (["torch", "speed-up", "target", "result"] if has_ref
                                                  else ["target", "result"])
        table = Table(headers, "llrrrll" if has_ref else "llrll")
        section = None
        for row in self.rows:
            if row.section != section:
                if section is not None:
                    table.separator()
                section = row.section
                table.add(f"[{section}]", *[""] * (len(headers) - 1))
            ours = "FAILED" if DISTLIB in row.errors else fmt_value(row.median(DISTLIB), row.unit)
            target = row.target.text if row.target else ""
            result = row.result() if row.target else ""
            if has_ref:
                theirs = "FAILED" if TORCH in row.errors else fmt_value(row.median(TORCH), row.unit)
                table.add("  " + row.name, row.unit if row.unit != "s" else "time", ours, theirs,
                          fmt_speedup(row.speedup()), target, result)
            else:
                if result == common.NOT_MEASURED:
                    result = "n/a (no torch)"
                table.add("  " + row.name, row.unit if row.unit != "s" else "time", ours, target, result)
        return table.render()

    def latency_table(self) -> Optional[str]:
        rows = [r for r in self.rows if r.section == "single client"]
        if not rows:
            return None
        table = Table(["single client, median us per call"] + [f"{impl} p50" for impl in self.impls]
                      + [f"{impl} p90" for impl in self.impls])
        for row in rows:
            cells = []
            for q in ("p50_us", "p90_us"):
                for impl in self.impls:
                    vals = [d[q] for d in row.details.get(impl, [])]
                    cells.append(common.fmt_num(median(vals)) if vals else "-")
            table.add("  " + row.name, *cells)
        return table.render()

    def barrier_lines(self) -> List[str]:
        """Where a barrier round's time goes, per implementation: the medians over all
        rounds of the arrival (first ADD sent to the last arriver's SET) and the release
        (that SET to the last rank through)."""
        lines = []
        for row in self.rows:
            if row.section != "barrier":
                continue
            for impl in self.impls:
                details = [d for d in row.details.get(impl, []) if "arrival_s" in d]
                if details:
                    arrival = median([d["arrival_s"] for d in details])
                    release = median([d["release_s"] for d in details])
                    lines.append(f"  {row.name.split(':')[0]}, {impl}: arrival {fmt_seconds(arrival)}, "
                                 f"release {fmt_seconds(release)}")
            paired = self.barrier_pairs.get(row.name)
            if paired is not None and paired.pairs:
                lines.append(f"  {row.name.split(':')[0]}, speed-up over {paired.pairs} paired iterations "
                             f"(torch time / distlib time, each pair back to back): median "
                             f"{fmt_speedup(paired.median)}, 95% CI {fmt_speedup(paired.low)} to "
                             f"{fmt_speedup(paired.high)}")
        return lines

    def storm_lines(self) -> List[str]:
        lines = []
        for impl, details in self.storm_details.items():
            for rnd, d in enumerate(details):
                hist = ", ".join(f"{k}: {v}" for k, v in d["histogram"].items())
                failed = f", {d['failed']} FAILED" if d["failed"] else ""
                lines.append(f"  {impl} round {rnd + 1}: constructor median {fmt_seconds(d['median_s'])}, "
                             f"max {fmt_seconds(d['max_s'])}; histogram {hist}{failed}")
        return lines

    def summary(self) -> Dict[str, int]:
        counts = {common.PASS: 0, common.MISS: 0, common.NOT_MEASURED: 0}
        for row in self.rows:
            if row.target:
                counts[row.result()] += 1
        return counts


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
    out = command.text_stream(args.json)
    say = Printer(args.quiet)

    if args.pin:
        os.sched_setaffinity(0, args.pin)  # every child inherits it
    if args.distlib_transport == "tcp":
        os.environ["DISTLIB_STORE_UNIX"] = "0"  # servers and clients, in every child
    impls, torch_version, why_not = common.implementations(args.no_torch)
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

    env = common.environment({"torch_backend": args.torch_backend if with_torch else None,
                              "distlib_transport": args.distlib_transport,
                              "client_transports": bench.transports})
    header = [
        f"distlib bench store: distlib {env['distlib']}"
        + (f" vs torch {torch_version} ({args.torch_backend} server)" if with_torch else
           f" (torch not measured: {why_not})"),
        f"{env['nproc']} CPUs ({env['cpu_model']}), Python {env['python']}, {env['platform']}; "
        + (f"pinned to CPUs {','.join(map(str, args.pin))}" if args.pin else "not pinned")
        + f"; servers and clients in separate processes; median of {args.rounds} interleaved round(s); "
          f"{wall:.0f} s",
        "transport: distlib clients "
        + ("over TCP (--distlib-transport tcp)" if args.distlib_transport == "tcp" else
           "over the server's same-host UNIX socket (the default; --distlib-transport tcp for TCP)")
        + "; torch clients over TCP; barrier ranks over TCP for both",
    ]
    print("\n".join(header), file=out)
    if bench.rows:
        print(file=out)
        print(bench.table(), file=out)
    if bench.security_bench is not None:
        print(file=out)
        print(bench.security_bench.table(), file=out)
        print("\n".join(bench.security_bench.lines()), file=out)
    lat = bench.latency_table()
    if lat:
        print(file=out)
        print(lat, file=out)
    phases = bench.barrier_lines()
    if phases:
        print(file=out)
        print("barrier rounds, median (arrival: first ADD to done set; release: done set to the last rank through):",
              file=out)
        print("\n".join(phases), file=out)
    storm = bench.storm_lines()
    if storm:
        print(file=out)
        print("connect storm, per round:", file=out)
        print("\n".join(storm), file=out)
    counts = bench.summary()
    print(file=out)
    print("speed-up = how many times better distlib is (ops/s: distlib/torch; times: torch/distlib). "
          f"targets: {counts[common.PASS]} PASS, {counts[common.MISS]} MISS"
          + (f", {counts[common.NOT_MEASURED]} not measurable without torch" if counts[common.NOT_MEASURED] else ""),
          file=out)
    for failure in failures:
        print(f"FAILED: {failure}", file=out)
    out.flush()

    if args.json:
        command.write_json(args.json, {
            "benchmark": "distlib bench store",
            "schema": 1,
            "environment": env,
            "config": {k: v for k, v in vars(args).items() if k not in ("json",)},
            "implementations": impls,
            "rows": [row.to_json(impls) for row in bench.rows],
            "connect_storm": bench.storm_details,
            "barrier_paired_speedup": {name: p.to_json() for name, p in bench.barrier_pairs.items()},
            "security": bench.security_bench.json_rows() if bench.security_bench is not None else None,
            "targets": counts,
            "failures": failures,
            "wall_seconds": round(wall, 3),
        })
    if failures:
        return 1
    if args.fail_on_miss and counts[common.MISS]:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
