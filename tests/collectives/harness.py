"""Real processes for collective tests, like torch's MultiProcessTestCase, kept alive and reused.

``WorkerPool(world_size)`` spawns one process per rank; each joins a process group (file://
by default) and then runs test functions on request: ``pool.run(fn, *args)`` calls
``fn(rank, world_size, *args)`` on every rank at once and returns the per-rank results, or
raises with every failing rank's traceback. Starting processes and groups once per world size
(instead of per case) keeps hundreds of cases fast on two cores.

Test functions must be module-level (they are pickled by reference).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import tempfile
import traceback
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional
from tests.fixtures.ports import free_port

CASE_TIMEOUT = 120.0


def _set_constants(constants: Dict[str, Any]) -> None:
    """Set module constants ("distlib.backends.gloo.algorithms.context.PIPE_BYTES": 16384) in this process."""
    import importlib

    for dotted, value in constants.items():
        module, _, name = dotted.rpartition(".")
        target = importlib.import_module(module)
        if not hasattr(target, name):
            raise AttributeError(f"{module} has no constant {name} to set")
        setattr(target, name, value)


def _worker(rank: int, world_size: int, init_method: str, conn, env: Dict[str, str], timeout_s: float,
            constants: Dict[str, Any]) -> None:
    os.environ.update(env)
    import distlib as dist

    _set_constants(constants)

    try:
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s))
        conn.send(("ready", None))
    except BaseException:  # noqa: BLE001 - reported to the parent
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        if message is None:
            break
        fn, args = message
        try:
            conn.send(("ok", fn(rank, world_size, *args)))
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass


class WorkerPool:
    def __init__(self, world_size: int, init: str = "file", env: Optional[Dict[str, str]] = None,
                 timeout_s: float = 60.0, constants: Optional[Dict[str, Any]] = None):
        self.world_size = world_size
        self._dir = tempfile.mkdtemp(prefix="distlib-pool-")
        if init == "file":
            init_method = f"file://{self._dir}/store"
        else:
            init_method = f"tcp://127.0.0.1:{free_port()}"
        ctx = mp.get_context("spawn")
        self._conns = []
        self._procs = []
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker, args=(rank, world_size, init_method, child, env or {}, timeout_s,
                                                          constants or {}),
                               daemon=True, name=f"rank{rank}")
            proc.start()
            self._conns.append(parent)
            self._procs.append(proc)
        self._collect("init", CASE_TIMEOUT)

    def _collect(self, what: str, timeout: float) -> List[Any]:
        results, errors = [], []
        for rank, conn in enumerate(self._conns):
            if not conn.poll(timeout):
                errors.append(f"rank {rank}: no answer to {what} within {timeout:.0f}s")
                results.append(None)
                continue
            try:
                status, value = conn.recv()
            except EOFError:
                errors.append(f"rank {rank}: process died (exit code {self._procs[rank].exitcode})")
                results.append(None)
                continue
            if status == "error":
                errors.append(f"rank {rank}:\n{value}")
            results.append(value)
        if errors:
            self.broken = True
            raise AssertionError(f"{what} failed on {len(errors)} rank(s):\n" + "\n".join(errors))
        return results

    def run(self, fn: Callable, *args, timeout: float = CASE_TIMEOUT) -> List[Any]:
        """``fn(rank, world_size, *args)`` on every rank; the list of their results."""
        for conn in self._conns:
            conn.send((fn, args))
        return self._collect(fn.__name__, timeout)

    def close(self) -> None:
        for conn in self._conns:
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for proc in self._procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join(5)


def spawn(fn: Callable, world_size: int, *args, timeout: float = CASE_TIMEOUT, env: Optional[Dict[str, str]] = None):
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` fresh processes (no group made);
    returns ``[(exitcode, result_or_traceback)]`` per rank."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_fresh, args=(fn, rank, world_size, args, queue, env or {}), daemon=True)
             for rank in range(world_size)]
    for proc in procs:
        proc.start()
    results: Dict[int, Any] = {}
    import queue as queue_module
    import time

    deadline = time.monotonic() + timeout
    while len(results) < world_size and time.monotonic() < deadline:
        try:
            rank, value = queue.get(timeout=0.2)
        except queue_module.Empty:
            if not any(proc.is_alive() for proc in procs):  # a dead rank never answers
                try:
                    rank, value = queue.get(timeout=1.0)  # a last word still in the pipe
                except queue_module.Empty:
                    break
            else:
                continue
        results[rank] = value
    for proc in procs:
        proc.join(15)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
    return [(procs[r].exitcode, results.get(r)) for r in range(world_size)]


def _fresh(fn: Callable, rank: int, world_size: int, args, queue, env: Dict[str, str]) -> None:
    os.environ.update(env)
    try:
        queue.put((rank, ("ok", fn(rank, world_size, *args))))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        queue.put((rank, ("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")))
