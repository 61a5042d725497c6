"""Helpers for the tests that run one rank per container (fixtures: tests/fixtures/docker.py).

Every rank runs ``python -m distlib_deploy.jobs.check_collectives`` (or the launcher around it) in
its own container on a private network, with a host name and a network alias ``node<r>``;
the tests read the one line each rank prints (``check_collectives: rank R/W OK ...`` or
``... FAILED after S s: <Error>: <message>``).
"""

from __future__ import annotations

import contextlib
import re
import time
from typing import Callable, Dict, Iterable, List, Optional

import pytest

from distlib_deploy.cluster import engine

CHECK = ["python", "-m", "distlib_deploy.jobs.check_collectives"]
OK_LINE = re.compile(r"check_collectives: rank (\d+)/(\d+) OK all_reduce=(\d+) all_gather=([\d,]+) host=(\S+) "
                     r"address=(\S+)")
FAILED_LINE = re.compile(r"check_collectives: rank (\S+) FAILED after ([\d.]+) s: (\w+): (.*)")


def expected_sum(world: int, n: int = 16) -> int:
    return world * n * (n - 1) // 2 + n * world * (world - 1) // 2


def logs(ctr) -> str:
    return engine.logs_text(ctr.get_wrapped_container() if hasattr(ctr, "get_wrapped_container") else ctr)


def wait_exit(ctr, timeout: float) -> int:
    """The container's exit status; fails the test (with its logs) if it runs past ``timeout``."""
    wrapped = ctr.get_wrapped_container() if hasattr(ctr, "get_wrapped_container") else ctr
    deadline = time.monotonic() + timeout
    while True:
        wrapped.reload()
        if wrapped.status in ("exited", "dead"):
            return int(wrapped.attrs["State"]["ExitCode"])
        if time.monotonic() > deadline:
            pytest.fail(f"container {wrapped.name} still running after {timeout:.0f} s (a hang); its logs:\n"
                        f"{logs(ctr)[-3000:]}", pytrace=False)
        time.sleep(0.2)


def wait_for_log(ctr, pattern: str, timeout: float) -> str:
    """Wait until the container's logs match ``pattern`` (regex); return the logs."""
    deadline = time.monotonic() + timeout
    rx = re.compile(pattern)
    while True:
        text = logs(ctr)
        if rx.search(text):
            return text
        wrapped = ctr.get_wrapped_container()
        wrapped.reload()
        if wrapped.status in ("exited", "dead") or time.monotonic() > deadline:
            pytest.fail(f"{wrapped.name}: no log line matching {pattern!r} within {timeout:.0f} s "
                        f"(status {wrapped.status}); its logs:\n{text[-3000:]}", pytrace=False)
        time.sleep(0.2)


def ip_of(ctr, network) -> str:
    wrapped = ctr.get_wrapped_container()
    wrapped.reload()
    return wrapped.attrs["NetworkSettings"]["Networks"][network.name]["IPAddress"]


def start_ranks(container_factory: Callable, image: str, network, world: int,
                command: Callable[[int], List[str]], env: Callable[[int], Dict[str, str]],
                ranks: Optional[Iterable[int]] = None, **kw) -> Dict[int, object]:
    """One container per rank: host name and alias ``node<r>``; returns {rank: container}.
    Each container's address on ``network`` is kept as ``container.ip`` (Docker forgets it
    when the container exits)."""
    started = {}
    for r in (range(world) if ranks is None else ranks):
        ctr = container_factory(image, command=command(r), network=network, aliases=[f"node{r}"],
                                hostname=f"node{r}", env=env(r), **kw)
        ctr.ip = ip_of(ctr, network)
        started[r] = ctr
    return started


def assert_all_ok(containers: Dict[int, object], world: int, timeout: float = 90) -> Dict[int, re.Match]:
    """Every rank exits 0 having printed a correct OK line; returns the matches by rank."""
    found = {}
    for r, ctr in containers.items():
        code = wait_exit(ctr, timeout)
        text = logs(ctr)
        assert code == 0, f"rank {r} exited with {code}:\n{text[-3000:]}"
        match = OK_LINE.search(text)
        assert match, f"rank {r} printed no OK line:\n{text[-3000:]}"
        assert int(match.group(1)) == r and int(match.group(2)) == world, match.group(0)
        assert int(match.group(3)) == expected_sum(world), match.group(0)
        assert match.group(4) == ",".join(str(k) for k in range(world)), match.group(0)
        found[r] = match
    return found


def failure_line(ctr) -> re.Match:
    text = logs(ctr)
    match = FAILED_LINE.search(text)
    assert match, f"no FAILED line in:\n{text[-3000:]}"
    return match


@contextlib.contextmanager
def named_volumes(docker_client):
    """Factory of labelled named volumes, for the block. Afterwards the containers still using
    them are removed first (they belong to this test), then the volumes."""
    from tests.fixtures.docker import SESSION_ID, labelled

    made = []

    def make(hint: str):
        volume = docker_client.volumes.create(name=f"distlib-test-{hint}-{len(made)}-{SESSION_ID}",
                                              labels=labelled())
        made.append(volume)
        return volume

    try:
        yield make
    finally:
        for volume in made:
            with contextlib.suppress(Exception):
                for ctr in docker_client.containers.list(all=True, filters={"volume": volume.name}):
                    with contextlib.suppress(Exception):
                        ctr.remove(force=True)
                volume.remove(force=True)
