"""Helpers for launcher tests that start real processes on localhost."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from typing import Dict, List, Optional

import pytest

from distlib.store_service import StoreServerProcess
from tests.fixtures.ports import free_port  # noqa: F401 - the launcher tests take it from here
from tests.fixtures.procfs import pid_alive  # noqa: F401 - the launcher tests take it from here

#: Variables a cluster or an outer launcher may have set in the test runner's environment; the
#: launcher would read them (that is its job), so the tests start from an environment without.
_CLUSTER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "MASTER_ADDR",
                 "MASTER_PORT", "JOB_COMPLETION_INDEX", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE",
                 "DISTLIB_RUN_ID", "DISTLIB_EXTERNAL_STORE", "DISTLIB_INIT_METHOD", "VC_TASK_INDEX",
                 "VK_TASK_INDEX", "OMP_NUM_THREADS")
_CLUSTER_PREFIXES = ("PET_", "LWS_", "VC_", "SLURM_")


def clean_env(**extra: str) -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in _CLUSTER_VARS and not k.startswith(_CLUSTER_PREFIXES)}
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def launcher_cmd(*args: str) -> List[str]:
    return [sys.executable, "-m", "distlib.run", "--log-level", "INFO", *args]


def run_launcher(*args: str, env: Optional[Dict[str, str]] = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(launcher_cmd(*args), env=env or clean_env(), capture_output=True, text=True,
                          timeout=timeout)


def start_launcher(*args: str, env: Optional[Dict[str, str]] = None) -> subprocess.Popen:
    return subprocess.Popen(launcher_cmd(*args), env=env or clean_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


class StreamText:
    """Everything a child wrote to one of its pipes so far (``text``), read by a thread as it
    comes, partial lines included, so that a test can wait for a line before it acts. Read the
    pipe through this only."""

    def __init__(self, pipe):
        self._fd = pipe.fileno()
        self._chunks: List[bytes] = []
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while True:
            chunk = os.read(self._fd, 65536)
            if not chunk:
                return
            self._chunks.append(chunk)

    @property
    def text(self) -> str:
        return b"".join(self._chunks).decode(errors="replace")

    def wait_for(self, words: str, timeout: float) -> None:
        """Return once ``words`` were written; AssertionError with what was, after ``timeout``."""
        deadline = time.monotonic() + timeout
        while words not in self.text:
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout} s waiting for {words!r}; the output:\n"
                                     f"{self.text[-3000:]}")
            time.sleep(0.02)

    def rest(self, timeout: float = 30) -> str:
        """All of it, once the pipe closed (the child exited)."""
        self._thread.join(timeout)
        assert not self._thread.is_alive(), f"the pipe was still open after {timeout} s"
        return self.text


@pytest.fixture
def store_server():
    """A `distlib store-server` subprocess on a free port of 127.0.0.1; yields the port."""
    with StoreServerProcess("127.0.0.1", env=clean_env()) as server:
        yield server.port


# -- elastic jobs (tests/launcher/elastic_job.py) ----------------------------------------------------


@pytest.fixture(params=["tcp", "file"])
def endpoint(request, tmp_path):
    """A rendezvous endpoint: a `distlib store-server` process, or a FileStore file."""
    if request.param == "file":
        yield f"file://{tmp_path}/rdzv/store"
        return
    with StoreServerProcess("127.0.0.1", env=clean_env()) as server:
        yield f"127.0.0.1:{server.port}"


@pytest.fixture
def tcp_endpoint():
    with StoreServerProcess("127.0.0.1", env=clean_env()) as server:
        yield f"127.0.0.1:{server.port}"


@pytest.fixture
def make_job(tmp_path):
    """make(endpoint, run id, nnodes, max restarts, ...) -> an elastic_job.Job; every agent killed
    at the end."""
    jobs = []

    from .elastic_job import Job  # elastic_job imports this module's helpers

    def make(*args, **kw) -> Job:
        job = Job(tmp_path, *args, **kw)
        jobs.append(job)
        return job

    yield make
    for job in jobs:
        job.kill_all()
