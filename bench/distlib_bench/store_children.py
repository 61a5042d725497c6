"""What runs in the store benchmark's children (bench/store.py describes the loads): the
clients of each load, the servers (``LoadServer``: distlib's ``distlib store-server`` or a
torch master, each in its own process), the barrier's load generators that speak the wire
protocol themselves, the connect storm and the FileStore replay.
"""

from __future__ import annotations

import select
import shutil
import socket
import tempfile
import threading
import time
from datetime import timedelta
from typing import Any, Dict, List, Optional, Sequence, Tuple

from distlib.net import raise_fd_limit

from distlib.store_service import StoreServerProcess
from .children import BenchError, Child
from .results import TORCH
from .timing import sleep_until, timed_loop

KEY_BYTES = 16
VALUE = b"v" * 32


def bench_key(prefix: str, i: int) -> str:
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


class LoadServer:
    """A server in its own process for one load; ``with LoadServer(...) as port:``. distlib's is
    ``distlib store-server`` (listening on every interface), as a deployment runs it; torch's a
    TCPStore master in a forked child."""

    def __init__(self, impl: str, use_libuv: bool, journal: str = "off"):
        self.impl = impl
        self.state_dir: Optional[str] = None
        if impl == TORCH:
            self.child = Child(_torch_server_child, use_libuv, name="torch-store-server")
        else:
            args: List[str] = []
            if journal != "off":  # a fresh state directory, the journal flushed as --journal says
                self.state_dir = tempfile.mkdtemp(prefix="distlib-bench-state-")
                args = ["--state-dir", self.state_dir, "--sync", journal]
            self.service = StoreServerProcess("127.0.0.1", listen_host="0.0.0.0", args=args)

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
            if self.state_dir is not None:
                shutil.rmtree(self.state_dir, ignore_errors=True)


def single_client_child(conn, impl: str, host: str, port: int, use_libuv: bool, seconds: float) -> Dict[str, Any]:
    store = _tcp_client(impl, host, port, use_libuv)
    keys = [bench_key("k", i) for i in range(1024)]
    key, counter = keys[0], bench_key("counter", 0)
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


def concurrent_client_child(conn, impl: str, host: str, port: int, use_libuv: bool, index: int,
                      pairs: int, go, start_at) -> Dict[str, float]:
    store = _tcp_client(impl, host, port, use_libuv)
    keys = [bench_key(f"c{index}.", j) for j in range(8)]
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


class BarrierRanks:
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


def storm_child(conn, impl: str, host: str, port: int, use_libuv: bool, clients: int,
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


def filestore_writer(conn, impl: str, path: str, keys: int) -> None:
    store = _file_store(impl, path)
    for i in range(keys):
        store.set(bench_key("f", i), VALUE)
    store.get(bench_key("f", keys - 1))
    conn.send(("ready",))
    _wait_for_stop(conn)
    del store


def filestore_reader(conn, impl: str, path: str, keys: int) -> float:
    t0 = time.perf_counter()
    store = _file_store(impl, path)
    value = store.get(bench_key("f", keys - 1))
    elapsed = time.perf_counter() - t0
    if value != VALUE:
        raise BenchError(f"read back {value!r}")
    del store
    return elapsed
