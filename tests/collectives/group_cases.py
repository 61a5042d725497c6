"""Functions for fresh processes (harness.spawn): init/destroy cycles, plugins, failures."""

import os
import time
from datetime import timedelta

import numpy as np


def _resources():
    """Open file descriptors, distlib threads, and /dev/shm mappings of this process."""
    import threading

    fds = len(os.listdir("/proc/self/fd"))
    threads = sorted(t.name for t in threading.enumerate() if t.name.startswith("distlib-") and t.is_alive())
    with open("/proc/self/maps") as maps:
        shm = sum(1 for line in maps if "/dev/shm/" in line)
    return fds, threads, shm


def init_destroy_init(rank, ws, path1, path2):
    """init -> collectives (TCP and shared memory) -> destroy, twice; destroy releases
    every socket, thread and shared-memory mapping."""
    import distlib as dist

    out = []
    before = _resources()
    for path in (path1, path2):
        dist.init_process_group("GLOO", init_method=f"file://{path}", rank=rank, world_size=ws,
                                timeout=timedelta(seconds=30))
        a = np.full(3, rank + 1.0)
        dist.all_reduce(a)
        big = np.ones(1 << 20, np.float32)  # shared-memory path
        dist.all_reduce(big)
        out.append((dist.is_initialized(), float(a[0]), dist.get_backend(), float(big[0])))
        dist.destroy_process_group()
        out.append(dist.is_initialized())
        time.sleep(0.2)
        out.append(_resources() == before or (_resources(), before))
    return out


def after_failure_reinit(rank, ws, path1, path2):
    """A collective that fails (mismatch) breaks the group; destroy and init again works."""
    import distlib as dist

    dist.init_process_group("gloo", init_method=f"file://{path1}", rank=rank, world_size=ws,
                            timeout=timedelta(seconds=30))
    try:
        dist.all_reduce(np.ones(5 + rank))
        failed = False
    except dist.DistBackendError:
        failed = True
    dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"file://{path2}", rank=rank, world_size=ws,
                            timeout=timedelta(seconds=30))
    a = np.ones(2)
    dist.all_reduce(a)
    dist.destroy_process_group()
    return failed, float(a[0])


def use_plugin(rank, ws, path):
    import distlib as dist

    from tests.collectives import plugin_backend

    dist.Backend.register_backend("storebackend", plugin_backend.create, devices=["cpu"])
    dist.init_process_group("storebackend", init_method=f"file://{path}", rank=rank, world_size=ws,
                            timeout=timedelta(seconds=30))
    a = np.arange(4, dtype=np.float64) * (rank + 1)
    dist.all_reduce(a, op=dist.ReduceOp.MAX)
    dist.barrier()
    backend = dist.get_backend()
    try:
        dist.broadcast(np.zeros(2), src=0)
        unsupported = "no error"
    except NotImplementedError as exc:
        unsupported = str(exc)
    dist.destroy_process_group()
    return a.tolist(), backend, dist.Backend.STOREBACKEND, unsupported


def join_with_missing_rank(rank, ws, port):
    """Ranks 0..ws-2 start; the last never does. Every started rank must fail within the
    timeout (plus a margin) with an error naming the missing rank."""
    import distlib as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(ws + 1),
                      LOCAL_WORLD_SIZE=str(ws + 1), GROUP_RANK="0")
    start = time.monotonic()
    try:
        dist.init_process_group("gloo", timeout=timedelta(seconds=4))
        return "joined?!", 0.0
    except dist.DistError as exc:
        return str(exc), time.monotonic() - start


def killed_during_all_reduce(rank, ws, port, victim):
    """The victim SIGKILLs itself in the middle of a large all_reduce; the others must raise
    DistBackendError naming it, well within the group timeout, and exit."""
    import signal
    import threading

    import distlib as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(ws),
                      DISTLIB_SHM="0")
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    big = np.ones(32 << 20, np.float32)  # 128 MiB: several hundred ms per all_reduce here
    dist.all_reduce(np.ones(1))
    if rank == victim:
        threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
    start = time.monotonic()
    try:
        for _ in range(50):
            dist.all_reduce(big)
        return "no error", time.monotonic() - start
    except dist.DistBackendError as exc:
        return str(exc), time.monotonic() - start


def _with_rank_2_stopped(rank, ws, path, before_stop, action):
    """Init (TCP only, 7 s timeout); rank 2 runs ``before_stop()`` and stops itself (SIGSTOP:
    not even its progress thread runs); ranks 0 and 1 run ``action()`` and return (its error
    text, or "no error"; seconds). Rank 0 kills rank 2 at the end."""
    import signal

    import distlib as dist

    os.environ["DISTLIB_SHM"] = "0"
    store = dist.FileStore(path + ".pids", ws)
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=ws,
                            timeout=timedelta(seconds=7))
    store.set(f"pid{rank}", str(os.getpid()))
    dist.barrier()
    start = time.monotonic()
    if rank == 2:
        before_stop()
        os.kill(os.getpid(), signal.SIGSTOP)
        return "resumed", 0.0
    try:
        action()
        return "no error", time.monotonic() - start
    except dist.DistBackendError as exc:
        return str(exc), time.monotonic() - start
    finally:
        if rank == 0:
            os.kill(int(store.get("pid2")), signal.SIGKILL)


def sender_blocked_on_a_stopped_rank(rank, ws, path):
    """Rank 2 is stopped, rank 1 sends it 64 MiB and blocks in the send, rank 0 waits for a
    message from rank 1. Rank 0's timeout must say that rank 1 is alive and blocked sending
    to rank 2, not that rank 1 is silent."""
    import distlib as dist

    def action():
        if rank == 1:
            time.sleep(0.5)  # rank 2 is stopped by now
            dist.send(np.ones(16 << 20, np.float32), dst=2)
        else:
            dist.recv(np.empty(1, np.float32), src=1)

    return _with_rank_2_stopped(rank, ws, path, lambda: None, action)


def progress_thread_stuck_mid_frame(rank, ws, path):
    """Rank 2 sends rank 1 the first bytes of a 1 MiB frame and stops, the way a rank cut off
    the network stops mid-frame: rank 1's progress thread is stuck reading the rest. Ranks 0
    and 1 wait for a message from each other (rank 1 starting a second later, so rank 0's
    wait expires first). Rank 0's timeout must say that rank 1 is alive, not silent."""
    import distlib as dist
    from distlib.distributed import get_default_group
    from distlib.backends.gloo.transport import frames

    def send_part_of_a_frame():
        time.sleep(0.5)
        mesh = next(iter(get_default_group().backends.values())).meshes[0]
        header = frames.pack(frames.P2P, frames.OPS["send"], 0, 0, 99, 0, 1 << 18, 1 << 20)
        mesh.conns[1].sock.sendall(header + bytes(100))

    def action():
        if rank == 1:
            time.sleep(1.0)
        dist.recv(np.empty(1, np.float32), src=1 - rank)

    return _with_rank_2_stopped(rank, ws, path, send_part_of_a_frame, action)


def port_range_init(rank, ws, path, low, high):
    import distlib as dist

    os.environ["DISTLIB_PORT_RANGE"] = f"{low}-{high}"
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=ws,
                            timeout=timedelta(seconds=30))
    from distlib.distributed import get_default_group

    mesh = get_default_group().backends["cpu"].meshes[0]
    port = mesh.listener.getsockname()[1]
    a = np.ones(2)
    dist.all_reduce(a)
    dist.destroy_process_group()
    return port, float(a[0])


def busy_port_range(rank, ws, path, port):
    import socket

    import distlib as dist

    blocker = socket.socket()
    blocker.bind(("0.0.0.0", port))
    blocker.listen()
    os.environ["DISTLIB_PORT_RANGE"] = f"{port}-{port}"
    try:
        dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=ws,
                                timeout=timedelta(seconds=5))
        return "no error"
    except dist.DistError as exc:
        return str(exc)
    finally:
        blocker.close()


def two_interfaces(rank, ws, path):
    import distlib as dist

    os.environ["GLOO_SOCKET_IFNAME"] = "lo,lo"
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=ws,
                            timeout=timedelta(seconds=30))
    from distlib.distributed import get_default_group

    meshes = len(get_default_group().backends["cpu"].meshes)
    results = []
    for i in range(4):  # alternate between the two meshes
        a = np.full(8, float(rank + i))
        dist.all_reduce(a)
        results.append(float(a[0]))
    dist.destroy_process_group()
    return meshes, results


def monitored_barrier_with_absent_rank(rank, ws, path, absent):
    """Rank ``absent`` never calls monitored_barrier: rank 0 names it, the others hear it failed."""
    import distlib as dist

    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=ws,
                            timeout=timedelta(seconds=30))
    start = time.monotonic()
    outcome = "skipped"
    if rank != absent:
        try:
            dist.monitored_barrier(timeout=timedelta(seconds=2), wait_all_ranks=True)
            outcome = "passed"
        except dist.DistBackendError as exc:
            outcome = str(exc)
    else:
        time.sleep(4)
    elapsed = time.monotonic() - start
    dist.destroy_process_group()
    return outcome, elapsed


def failing_async_op(rank, ws, path):
    """An async collective that fails (ranks disagree on the size) reports it on its Work."""
    import distlib as dist

    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=ws,
                            timeout=timedelta(seconds=30))
    work = dist.all_reduce(np.ones(10 + rank), async_op=True)
    try:
        work.wait()
        raised = None
    except dist.DistBackendError as exc:
        raised = str(exc)
    result = (raised, work.is_completed(), work.is_success(), str(work.exception()) == raised)
    future_raised = False
    try:
        work.get_future().wait()
    except dist.DistBackendError:
        future_raised = True
    dist.destroy_process_group()
    return result + (future_raised,)


def silent_rank_during_ring(rank, ws, path, silent):
    """Rank ``silent`` stops taking part (stuck outside distlib) while the others run a ring
    all_reduce; their timeout errors must blame it, not the live neighbour they wait on."""
    import distlib as dist

    os.environ["DISTLIB_SHM"] = "0"
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=ws,
                            timeout=timedelta(seconds=9))
    # 64 MiB: more than the sockets buffer, so the rank sending to the silent one blocks in
    # its send (and must still be reported alive)
    big = np.ones(16 << 20, np.float32)
    dist.all_reduce(big)
    if rank == silent:
        time.sleep(14)
        return "slept", 0.0
    start = time.monotonic()
    try:
        dist.all_reduce(big)
        return "no error", time.monotonic() - start
    except dist.DistBackendError as exc:
        return str(exc), time.monotonic() - start
