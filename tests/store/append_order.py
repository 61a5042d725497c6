"""The ordering check shared by test_tcp_store.py (a distlib client appends) and
test_tcp_store_interop.py (a torch client appends): the master handle, its server on a thread
of this process, sets a key; a client in another process appends to it and says so; the
master then reads the key and must see the append.

The master waits for the other process's word without a system call (shared-memory flags, a
busy loop), as a busy rank 0 computes, and the interpreter hands the GIL to a waiting thread
only after a second (``slow_thread_switches``): the server thread of this process then waits
for the interpreter until the master blocks, however slow the other process is on a loaded
machine. That is the condition the check is about (a loaded machine gives it too, less
reliably: 0 to 5 stale reads of 40 with the default 5 ms switch interval).
"""

from __future__ import annotations

import multiprocessing
import sys
import time
import traceback
from datetime import timedelta

import pytest

SPAWN = multiprocessing.get_context("spawn")
TRIES = 40
TIMEOUT_S = 60.0


@pytest.fixture
def slow_thread_switches():
    """sys.setswitchinterval(1.0) for the test (the module docstring says why)."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1.0)
    yield
    sys.setswitchinterval(before)


def _appender(impl: str, port: int, turn, done, errors) -> None:
    """A client of ``impl`` ("torch" or "distlib") in its own process: each time ``turn`` names
    a new try, APPEND "b" to that try's key (APPEND has no reply: the call returns once the
    bytes are sent), then set ``done`` to the try. Stops when ``turn`` is negative."""
    try:
        if impl == "torch":
            import torch.distributed as tdist

            client = tdist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=TIMEOUT_S))
        else:
            import os

            from distlib.store.tcp import TCPStore

            os.environ["DISTLIB_STORE_UNIX"] = "0"  # over TCP, as torch's client

            client = TCPStore("127.0.0.1", port, None, False, timedelta(seconds=TIMEOUT_S))
        done.value = 0
        while True:
            index = turn.value
            if index < 0:
                break
            if index > done.value:
                client.append(f"order/{index}", "b")
                done.value = index
    except BaseException:  # noqa: BLE001 - the parent shows it
        errors.put(traceback.format_exc())


def stale_reads(master, appender_impl: str, tries: int = TRIES) -> list:
    """Run ``tries`` tries of set (master) / append (the other process) / get (master);
    returns the tries whose get missed the append, as "try N: value"."""
    turn, done = SPAWN.RawValue("q", 0), SPAWN.RawValue("q", -1)
    errors = SPAWN.Queue()
    proc = SPAWN.Process(target=_appender, args=(appender_impl, master.port, turn, done, errors), daemon=True)
    proc.start()
    try:
        deadline = time.monotonic() + 180
        while done.value < 0:
            if not proc.is_alive() or time.monotonic() > deadline:
                raise AssertionError(f"the {appender_impl} client did not connect: "
                                     f"{errors.get(timeout=5) if not errors.empty() else 'no error reported'}")
            time.sleep(0.01)
        stale = []
        for index in range(1, tries + 1):
            master.set(f"order/{index}", "a")
            turn.value = index
            deadline = time.monotonic() + TIMEOUT_S
            while done.value != index:  # no system call: the server thread gets no turn meanwhile
                if time.monotonic() > deadline:
                    raise AssertionError(f"the {appender_impl} client did not append in try {index} within "
                                         f"{TIMEOUT_S:.0f} s (alive: {proc.is_alive()})")
            value = master.get(f"order/{index}")
            if value != b"ab":
                stale.append(f"try {index}: {value!r}")
        return stale
    finally:
        turn.value = -1
        proc.join(60)
        if proc.is_alive():
            proc.kill()
