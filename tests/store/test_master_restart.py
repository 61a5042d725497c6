"""A master service killed with SIGKILL and started again on the same port and state directory,
in the middle of a job's traffic: 16 clients streaming ADDs, 4 ranks in init_process_group, 4
clients in a store BARRIER. Every client completes, the counter equals the ADDs issued (none
lost, none applied twice), nobody hangs, and each client logged the outage in one line and its
end in another (the clients are processes: tests/store/restart_client.py)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from datetime import timedelta
from typing import List

import pytest

from distlib.errors import DistStoreError
from distlib.store import StoreStateLost
from distlib.store.tcp import TCPStore
from distlib.store_service import StoreServerProcess

pytestmark = pytest.mark.timeout(180)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LOST = "lost the connection to the store"
BACK = "reconnected to the store"


@pytest.fixture
def master(tmp_path):
    server = StoreServerProcess("127.0.0.1", args=["--state-dir", str(tmp_path / "state")],
                                log_path=str(tmp_path / "master.log"), log_level="INFO",
                                env=_env()).start()
    yield server
    server.stop()


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    for name in ("DISTLIB_AUTH_TOKEN", "DISTLIB_AUTH_TOKEN_FILE", "DISTLIB_TLS_CA", "DISTLIB_TLS_CERT",
                 "DISTLIB_TLS_KEY"):
        env.pop(name, None)
    return env


def spawn(mode: str, port: int, who: int, tmp_path) -> subprocess.Popen:
    err = open(tmp_path / f"{mode}-{who}.err", "w")
    return subprocess.Popen([sys.executable, "-m", "tests.store.restart_client", mode, str(port), str(who)],
                            cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=err, text=True)


def finish(procs: List[subprocess.Popen], tmp_path, mode: str) -> List[str]:
    """Each client's stdout, once it exited 0 (within the test's time: a hang fails here)."""
    outs = []
    for who, proc in enumerate(procs):
        try:
            out, _ = proc.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()
            pytest.fail(f"{mode} client {who} hung after the master's restart: {stderr_of(tmp_path, mode, who)}")
        assert proc.returncode == 0, f"{mode} client {who} failed ({proc.returncode}): {stderr_of(tmp_path, mode, who)}"
        outs.append(out)
    return outs


def stderr_of(tmp_path, mode: str, who: int) -> str:
    return (tmp_path / f"{mode}-{who}.err").read_text()


def outage_lines(tmp_path, mode: str, who: int, port: int) -> List[str]:
    text = stderr_of(tmp_path, mode, who)
    lost = [line for line in text.splitlines() if LOST in line]
    back = [line for line in text.splitlines() if BACK in line]
    assert len(lost) == 1 and f"127.0.0.1:{port}" in lost[0], f"{mode} client {who} logged {lost} for the outage"
    assert len(back) == 1, f"{mode} client {who} logged {back} for the end of the outage"
    return lost + back


def until(condition, what: str, seconds: float = 60.0) -> None:
    """Poll ``condition`` (each poll a store round trip) until true; fail naming ``what``."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} did not happen within {seconds:.0f} s")


def checker(port: int) -> TCPStore:
    return TCPStore("127.0.0.1", port, timeout=timedelta(seconds=60))


def test_16_clients_streaming_adds_lose_none_and_repeat_none(master, tmp_path):
    port = master.port
    clients = [spawn("adds", port, i, tmp_path) for i in range(16)]
    probe = checker(port)
    probe.wait([f"started/{i}" for i in range(16)], timedelta(seconds=60))
    before = probe.add("counter", 0)
    until(lambda: probe.add("counter", 0) >= before + 200, "200 more ADDs")  # all mid-stream (until "stop")
    probe.close()
    master.kill()
    master.start()
    probe = checker(port)
    resumed = probe.add("counter", 0)
    until(lambda: probe.add("counter", 0) >= resumed + 200, "200 ADDs after the restart")
    probe.set("stop", b"1")
    outs = finish(clients, tmp_path, "adds")
    issued = [int(out.split()[-1]) for out in outs]
    total = probe.add("counter", 0)
    probe.close()
    assert total == sum(issued), (f"the counter is {total} after {sum(issued)} ADDs ({issued}): "
                                  f"{'lost' if total < sum(issued) else 'applied twice'}: {total - sum(issued)}")
    for who in range(16):
        outage_lines(tmp_path, "adds", who, port)


def test_a_store_barrier_completes_across_the_restart(master, tmp_path):
    port = master.port
    early = [spawn("barrier", port, i, tmp_path) for i in range(3)]
    probe = checker(port)
    until(lambda: probe.add("the-barrier", 0) >= 3, "3 arrivals at the barrier")  # (its counter)
    probe.close()
    master.kill()
    master.start()
    late = spawn("barrier", port, 3, tmp_path)
    outs = finish(early + [late], tmp_path, "barrier")
    assert all(out.split()[-1] == "passed" for out in outs), outs
    probe = checker(port)
    assert probe.add("the-barrier", 0) == 4, "a re-sent BARRIER was counted twice"
    probe.close()
    for who in range(3):
        outage_lines(tmp_path, "barrier", who, port)


def test_init_process_group_of_4_ranks_completes_across_the_restart(master, tmp_path):
    port = master.port
    early = [spawn("rank", port, r, tmp_path) for r in range(3)]
    probe = checker(port)
    until(lambda: probe.num_keys() >= 3, "3 ranks' claims")  # (join.py) they wait for the fourth
    probe.close()
    master.kill()
    master.start()
    late = spawn("rank", port, 3, tmp_path)
    outs = finish(early + [late], tmp_path, "rank")
    sums = [out.split()[-1] for out in outs]
    assert sums == ["10"] * 4, f"all_reduce after the restart gave {sums} (rank order), 10 each expected"
    for rank in range(3):
        outage_lines(tmp_path, "rank", rank, port)



def test_a_master_back_without_its_state_fails_its_waiting_clients_at_once(tmp_path):
    """A master restarted without --state-dir serves a new, empty state: a client waiting on a
    key (timeout 120 s, reconnecting for as long) fails as soon as it is back, naming the
    master and saying its keys are gone, instead of waiting out its timeout for them."""
    server = StoreServerProcess("127.0.0.1", log_path=str(tmp_path / "master.log"), log_level="INFO",
                                env=_env()).start()
    port = server.port
    said = _Said()
    logging.getLogger("distlib.store.tcp.client").addHandler(said)
    try:
        client = TCPStore("127.0.0.1", port, timeout=timedelta(seconds=120))
        client.set("written-before", b"1")
        errors: List[BaseException] = []
        waiter = threading.Thread(target=_wait_for_key, args=(client, errors), daemon=True)
        waiter.start()
        until(lambda: client.ordered_waits and waiter.is_alive(), "the client's WAIT")
        server.kill()
        until(lambda: said.has(f"lost the connection to the store 127.0.0.1:{port} during WAIT"),
              "the client's line saying it reconnects")
        server.start()
        back = time.monotonic()
        waiter.join(60)
        assert not waiter.is_alive(), "the client still waits for a key of the master's lost state"
        took = time.monotonic() - back
        assert errors and isinstance(errors[0], DistStoreError), f"the wait ended with {errors!r}"
        text = str(errors[0])
        assert isinstance(errors[0], StoreStateLost), text
        assert f"127.0.0.1:{port}" in text and "came back without the keys it held" in text, text
        assert "during WAIT" in text and "--state-dir" in text, text
        assert took < 30, f"the client failed {took:.1f} s after the master was back, not at once"
        assert not said.has("reconnected to the store"), "the client said it resumed on an empty master"
        lines = len(said.lines)
        with pytest.raises(StoreStateLost, match=r"^GET not sent: lost the connection to the store .* during WAIT"):
            client.get("written-before")  # a later call: at once, with no new retry and no new line
        assert len(said.lines) == lines, said.lines[lines:]
    finally:
        logging.getLogger("distlib.store.tcp.client").removeHandler(said)
        server.stop()


def test_a_master_back_with_its_state_keeps_its_incarnation(tmp_path, master):
    """The same state directory is the same state: a client that reconnects goes on."""
    port = master.port
    client = TCPStore("127.0.0.1", port, timeout=timedelta(seconds=60))
    client.set("k", b"v")
    first = client._incarnation
    master.kill()
    master.start()
    assert client.get("k") == b"v"
    assert first is not None and len(first) == 16 and client._incarnation == first
    client.close()


class _Said(logging.Handler):
    """The log lines of the clients of this process, as they come."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: List[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def has(self, words: str) -> bool:
        return any(words in line for line in list(self.lines))


def _wait_for_key(client: TCPStore, errors: List[BaseException]) -> None:
    try:
        client.wait(["never-set"])
    except BaseException as exc:  # noqa: BLE001 - the test reads what ended the wait
        errors.append(exc)


def test_ranks_in_init_fail_at_once_naming_a_master_that_came_back_empty(tmp_path):
    """3 of 4 ranks wait in init_process_group (timeout 60 s) on a master without --state-dir,
    which is SIGKILLed and started again: each rank fails with StoreStateLost, its group's label
    and the master named, once it is back, with one log line for the outage and none for a
    second call."""
    server = StoreServerProcess("127.0.0.1", log_path=str(tmp_path / "master.log"), env=_env()).start()
    port = server.port
    try:
        ranks = [spawn("rank", port, r, tmp_path) for r in range(3)]
        probe = checker(port)
        until(lambda: probe.num_keys() >= 3, "3 ranks' claims")
        probe.close()
        server.kill()
        server.start()
        back = time.monotonic()
        for r, proc in enumerate(ranks):
            try:
                proc.communicate(timeout=40)
            except subprocess.TimeoutExpired:
                proc.kill()
                pytest.fail(f"rank {r} still waits {time.monotonic() - back:.0f} s after the master came back "
                            f"empty: {stderr_of(tmp_path, 'rank', r)}")
            text = stderr_of(tmp_path, "rank", r)
            assert proc.returncode != 0, f"rank {r} went on with a master that lost its keys: {text}"
            ended = text.strip().splitlines()[-1]
            assert ended.startswith(f"distlib.store.tcp.reconnecting.StoreStateLost: pg0/gloo rank {r}: lost the "
                                    f"connection to the store 127.0.0.1:{port} during WAIT"), text
            assert "came back without the keys it held" in ended, text
            said = [line for line in text.splitlines() if line.startswith("distlib.store.tcp.client:") and LOST in line]
            assert len(said) == 1, f"rank {r} logged {len(said)} outage lines: {text}"
    finally:
        server.stop()
