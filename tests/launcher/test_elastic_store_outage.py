"""Elastic distlib-run when its rendezvous store goes away (issue 36, "Elastic agents that ride
it out"): real agents, a real `distlib store-server` that is frozen or killed.

* frozen (SIGSTOP) for 5 s, well within the bound: the workers keep running, nobody is declared
  lost, the job completes in round 0 (restart count 0), and every node's log and the job's
  state say the store was away and for how long;
* killed and not back within --store-outage-timeout: every node fails naming it within the
  bound + 10 s (it is started again after the bound: the nodes are gone by then);
* back within the bound but empty (no journal): every node fails saying it lost the job;
* killed (SIGKILL) and started again 5 s later on the same port with the same --state-dir:
  the journal brings the job's keys back, and the job completes in round 0 (restart count 0),
  every node reporting the absence.
"""

from __future__ import annotations

import re
import signal
import time

import pytest

from distlib.launcher import rounds as R
from distlib.store_service import StoreServerProcess

from .conftest import clean_env

pytestmark = pytest.mark.timeout(180)

#: the heartbeat bound 2 s (as the other process tests: 0.5 s x 4); one store call of an agent
#: slower than 1 s (half the bound) met a store that was away
CONF = "keep_alive_interval=0.5,keep_alive_max_attempt=4,last_call_timeout=3,join_timeout=30"


class JournaledServer(StoreServerProcess):
    """`distlib store-server --state-dir DIR`: its keys journaled in DIR and replayed at start."""

    def __init__(self, *args, state_dir: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.state_dir = state_dir

    def command(self, port: int) -> list:
        return super().command(port) + ["--state-dir", self.state_dir]


@pytest.fixture
def server():
    """A `distlib store-server` this test may freeze or kill (with ``state_dir``: journaled
    there); stopped at the end."""
    made = []

    def start(port: int = 0, state_dir=None) -> StoreServerProcess:
        if state_dir is None:
            made.append(StoreServerProcess("127.0.0.1", port, env=clean_env()).start())
        else:
            made.append(JournaledServer("127.0.0.1", port, env=clean_env(), state_dir=str(state_dir)).start())
        return made[-1]

    yield start
    for s in made:
        if s.proc is not None and s.proc.poll() is None:
            s.proc.send_signal(signal.SIGCONT)
        s.stop()


def away_lines(text: str, endpoint: str) -> list:
    """The seconds of each absence a node's final report lists."""
    return [float(s) for s in re.findall(rf"^distlib-run: the rendezvous store \(TCPStore server {re.escape(endpoint)}\) "
                                         r"was away for ([\d.]+) s in round 0 \(from [\d-]+ [\d:]+ UTC\): the job went "
                                         r"on in the same round, no restart counted$", text, re.M)]


def test_a_master_frozen_for_5_s_is_ridden_out_in_the_same_round(make_job, server):
    """3 nodes, --nnodes 2:3: the master service stops (SIGSTOP) for 5 s while the workers train.
    Every agent's calls hang; the heartbeat bound (2 s) passes many times over; when the master
    answers again, nobody is lost: the job completes in round 0 with restart count 0, and every
    node reports the absence (about 5 s)."""
    master = server()
    endpoint = master.endpoint
    job = make_job(endpoint, "frozen-master", "2:3", 3, conf=CONF, EW_STEPS="300", EW_STEP_S="0.05")
    job.start(3)
    job.started(0, 3)
    master.proc.send_signal(signal.SIGSTOP)
    time.sleep(5.0)  # the stimulus: how long the master is away (not an ordering wait)
    master.proc.send_signal(signal.SIGCONT)
    codes = job.wait(timeout=120)
    assert set(codes.values()) == {0}, [job.log(a)[-3000:] for a in job.agents]
    assert sorted(job.records(0)) == [0, 1, 2] and not job.records(1), "the job restarted"
    for rank, rec in job.records(0).items():
        assert rec["env"]["TORCHELASTIC_RESTART_COUNT"] == "0" and rec["sum"] == 3.0, (rank, rec)
    state = job.state()
    assert state.round == 0 and state.phase == R.SUCCEEDED, state
    assert len(state.outages) == 1 and 4.0 <= state.outages[0].seconds <= 30.0, state.outages
    for agent in job.agents:
        text = job.log(agent)
        assert "node lost" not in text and "round 1" not in text, text[-3000:]
        assert re.search(rf"the rendezvous store \(TCPStore server {re.escape(endpoint)}\) (took \S+ to answer \(.*\)|"
                         r"answers again after \S+ away): the job goes on where it was, no restart", text), text[-3000:]
        (seconds,) = away_lines(text, endpoint)
        assert seconds == pytest.approx(state.outages[0].seconds, abs=0.06), (seconds, state.outages)


def test_a_master_away_past_the_bound_fails_every_node_naming_it_within_the_bound_and_10_s(make_job, server):
    """--store-outage-timeout 6: the master service is killed, and started again (empty) only
    after the bound. Every agent stops waiting for it, names it and fails, within 6 + 10 s of
    the kill; none is still waiting when it is back."""
    bound = 6.0
    master = server()
    port, endpoint = master.port, master.endpoint
    job = make_job(endpoint, "master-gone", "2:3", 3, conf=CONF, EW_STEPS="2000", EW_STEP_S="0.05")
    job.args += ["--store-outage-timeout", str(bound)]
    job.start(3)
    job.started(0, 3)
    master.proc.kill()
    killed_at = time.monotonic()
    master.proc.wait(10)
    deadline = killed_at + bound + 10
    ended = {}
    while len(ended) < len(job.agents) and time.monotonic() < deadline:
        for agent in job.agents:
            if agent.pid not in ended and agent.poll() is not None:
                ended[agent.pid] = time.monotonic() - killed_at
        time.sleep(0.05)
    back = server(port)  # after the bound: too late for the job
    assert len(ended) == 3, f"still running {bound + 10:g} s after the kill: " + "\n".join(
        job.log(a)[-2000:] for a in job.agents if a.pid not in ended)
    assert back.proc.poll() is None
    for agent in job.agents:
        text = job.log(agent)
        assert agent.returncode == 1, (agent.returncode, text[-3000:])
        assert "launcher/elastic_agent.py" not in text, text[-3000:]  # no crash
        assert re.search(rf"the rendezvous store \(TCPStore server {re.escape(endpoint)}\) did not answer .*: the "
                         r"workers keep running; retrying for up to 6\.0s \(--store-outage-timeout\)", text), text[-3000:]
        assert re.search(rf"the elastic job cannot go on: the rendezvous store \(TCPStore server {re.escape(endpoint)}\) "
                         r"did not answer for \S+ \(.*; --store-outage-timeout 6\.0s\)", text), text[-3000:]
    assert max(ended.values()) <= bound + 10, ended


def test_a_master_restarted_empty_within_the_bound_fails_every_node_saying_it_lost_the_job(make_job, server):
    """A master service that comes back within the bound but without its state (no --state-dir:
    nothing kept) answers, without the job: every node fails naming the store, no crash."""
    master = server()
    port, endpoint = master.port, master.endpoint
    job = make_job(endpoint, "store-restarted", "2", 3, conf=CONF, EW_STEPS="1000")
    job.start(2)
    job.started(0, 2)
    master.stop()
    server(port)
    restarted_at = time.monotonic()
    codes = job.wait(timeout=60)
    assert set(codes.values()) == {1}, codes
    assert time.monotonic() - restarted_at < 30
    for agent in job.agents:
        text = job.log(agent)
        assert "launcher/elastic_agent.py" not in text, text[-3000:]  # the agent did not crash
        assert re.search(rf"the elastic job cannot go on: the rendezvous store \(TCPStore server {endpoint}\) answers "
                         r"again but no longer holds run 'store-restarted'", text), text[-2000:]


def test_a_master_killed_and_back_with_its_journal_after_5_s_is_ridden_out_in_the_same_round(make_job, server,
                                                                                             tmp_path):
    """3 nodes, --nnodes 2:3, the rounds on a master that journals to --state-dir: SIGKILL it
    mid-training and start it again 5 s later on the same port with the same directory. The
    agents keep their workers running while it is away; it comes back with the run's keys, and
    the job completes in round 0 with restart count 0, every node reporting the absence (the
    kill's 5 s, plus the restart)."""
    state = tmp_path / "master-state"
    master = server(state_dir=state)
    port, endpoint = master.port, master.endpoint
    job = make_job(endpoint, "master-journaled", "2:3", 3, conf=CONF, EW_STEPS="300", EW_STEP_S="0.05")
    job.start(3)
    job.started(0, 3)
    master.proc.kill()
    master.proc.wait(10)
    time.sleep(5.0)  # the stimulus: how long the master stays dead (not an ordering wait)
    server(port, state_dir=state)
    codes = job.wait(timeout=120)
    assert set(codes.values()) == {0}, [job.log(a)[-3000:] for a in job.agents]
    assert sorted(job.records(0)) == [0, 1, 2] and not job.records(1), "the job restarted"
    for rank, rec in job.records(0).items():
        assert rec["env"]["TORCHELASTIC_RESTART_COUNT"] == "0" and rec["sum"] == 3.0, (rank, rec)
    state_now = job.state()
    assert state_now.round == 0 and state_now.phase == R.SUCCEEDED, state_now
    assert len(state_now.outages) == 1 and 5.0 <= state_now.outages[0].seconds <= 30.0, state_now.outages
    for agent in job.agents:
        text = job.log(agent)
        assert "node lost" not in text and "round 1" not in text and "no longer holds run" not in text, text[-3000:]
        (seconds,) = away_lines(text, endpoint)
        assert seconds == pytest.approx(state_now.outages[0].seconds, abs=0.06), (seconds, state_now.outages)
    print(f"\n[master killed, back with its journal after 5 s] away {state_now.outages[0].seconds:.1f} s "
          f"(every node's report); the job completed in round 0")
