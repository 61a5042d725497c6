"""Elastic distlib-run with real processes: several agents, each its own process, on a real
TCPStore (a `distlib store-server`) or a FileStore (``--rdzv-endpoint file://``), their workers
joining real gloo groups (tests/launcher/elastic_worker.py).

Each of torch's elastic bugs named in issue 29 has a test here that would catch it:
#108158 (a restart count per node, --max-restarts per node), #147064 (an agent killed: the
other hangs; a quick leave-and-rejoin bypasses --max-restarts), #182221 (a node moving to
rank 0 crashes the rendezvous), #123678 (a node's shutdown during a restart closes the
rendezvous for everyone). The heartbeat bound is 2 s here (0.5 s x 4) so the tests are quick.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess

import pytest

from distlib.launcher import rounds as R
from distlib.store.tcp.client import TCPStore

from .conftest import clean_env, launcher_cmd, pid_alive, wait_for
from .elastic_job import WORKER, round_lines

pytestmark = pytest.mark.timeout(180)

# -- restarts and the job's count -----------------------------------------------------------------------


def test_a_worker_crash_restarts_every_node_with_the_jobs_count(make_job, endpoint):
    """torch #108158: after node 1's worker crashed, every worker of round 1 — on the healthy
    nodes too — sees TORCHELASTIC_RESTART_COUNT=1, and each node printed one line for it."""
    job = make_job(endpoint, "crash-once", "2:3", 2, EW_CRASH="0:1")
    job.start(3)
    assert set(job.wait().values()) == {0}, [job.log(a)[-2000:] for a in job.agents]
    records = job.records(1)
    assert sorted(records) == [0, 1, 2]
    for rank, rec in records.items():
        assert rec["env"]["TORCHELASTIC_RESTART_COUNT"] == "1", (rank, rec)
        assert rec["env"]["TORCHELASTIC_MAX_RESTARTS"] == "2" and rec["env"]["WORLD_SIZE"] == "3"
        assert rec["sum"] == 3.0, (rank, rec)
    for agent in job.agents:
        lines = round_lines(job.log(agent))
        assert len(lines) == 1, job.log(agent)
        assert lines[0].startswith("round 1 (restart 1 of at most 2): worker failed: global rank 1 (local rank 0)")
        assert "exited with code 3; now 3 node(s), world size 3" in lines[0]


def test_max_restarts_is_job_wide_and_the_failure_lists_every_round(make_job, endpoint):
    """torch #108158: --max-restarts 2 with a worker that crashes every time: the job fails after
    two restarts in all — not two per node — and every node lists the three rounds."""
    job = make_job(endpoint, "crash-always", "3", 2, EW_CRASH="*:1")
    job.start(3)
    codes = job.wait()
    assert set(codes.values()) == {1}, codes
    for agent in job.agents:
        text = job.log(agent)
        assert "no restarts are left (--max-restarts 2: 2 used)" in text, text[-3000:]
        listed = re.findall(r"^distlib-run:   (round \d+): (.*)$", text, re.M)
        assert [r for r, _ in listed] == ["round 0", "round 1", "round 2"], text[-3000:]
        assert listed[0][1].startswith("start -> 3 node(s), world size 3")
        assert all(cause.startswith("worker failed: global rank 1") for _, cause in listed[1:]), listed
    assert job.state().round == 2


# -- nodes lost, nodes joining --------------------------------------------------------------------------


def test_a_lost_node_rank_0_leaves_a_smaller_job_with_stable_ranks(make_job, endpoint):
    """torch #182221 and #147064: node rank 0's agent is SIGKILLed (its workers die with it).
    The survivors notice within the heartbeat bound, form round 1 without it — node rank 1
    keeps its rank, node 2 moves to rank 0 — and finish; nobody hangs."""
    job = make_job(endpoint, "lose-0", "2:3", 3, EW_STEPS="120", EW_STEP_S="0.05")
    job.start(3)
    by_rank = job.started(0, 3)
    victim = job.agent_of(by_rank[0])
    victim.send_signal(signal.SIGKILL)
    survivors = [a for a in job.agents if a is not victim]
    codes = job.wait(survivors)
    assert set(codes.values()) == {0}, [job.log(a)[-3000:] for a in survivors]
    records = job.records(1)
    assert sorted(records) == [0, 1]
    agent_rank = {rec["agent"]: int(rec["env"]["GROUP_RANK"]) for rec in records.values()}
    assert agent_rank[by_rank[1]] == 1  # kept its rank
    assert agent_rank[by_rank[2]] == 0  # the lost rank 0 refilled
    for rec in records.values():
        assert rec["env"]["WORLD_SIZE"] == "2" and rec["sum"] == 2.0 and rec["env"]["TORCHELASTIC_RESTART_COUNT"] == "1"
    for agent in survivors:
        (line,) = round_lines(job.log(agent))
        assert re.search(rf"node lost: \S+ \(\S+, pid {victim.pid}\): no heartbeat for \d+ s", line), line
        assert "now 2 node(s), world size 2" in line


def test_below_min_the_survivor_fails_after_the_join_timeout_naming_the_lost_node(make_job, tcp_endpoint):
    job = make_job(tcp_endpoint, "too-few", "2", 3, EW_STEPS="400",
                   conf="keep_alive_interval=0.5,keep_alive_max_attempt=4,join_timeout=4")
    job.start(2)
    by_rank = job.started(0, 2)
    victim = job.agent_of(by_rank[1])
    victim.send_signal(signal.SIGKILL)
    survivor = job.agent_of(by_rank[0])
    assert job.wait([survivor], 60)[survivor.pid] == 1
    text = job.log(survivor)
    assert re.search(r"round 1: 1 node\(s\) joined \(.*\), fewer than the minimum 2, within the join timeout of 4 s; "
                     rf"gone from round 0: \S+ \(\S+, pid {victim.pid}\): node lost: .*no heartbeat for \d+ s", text), \
        text[-3000:]


def test_at_min_the_round_closes_after_the_last_call(make_job, endpoint):
    """--nnodes 2:3 and only two nodes: round 0 waits out the last call (3 s) and runs with 2."""
    job = make_job(endpoint, "last-call", "2:3", 0, EW_STEPS="5")
    job.start(2)
    assert set(job.wait().values()) == {0}
    assert sorted(job.records(0)) == [0, 1] and job.records(0)[0]["env"]["WORLD_SIZE"] == "2"
    assert any("round 0: 2 of 2..3 node(s) joined" in job.log(a) for a in job.agents)


def test_a_late_node_is_admitted_at_the_next_round(make_job, endpoint):
    job = make_job(endpoint, "late", "2:3", 1, EW_STEPS="100", EW_STEP_S="0.05")
    job.start(2)
    job.started(0, 2)
    (late,) = job.start(1)
    assert set(job.wait().values()) == {0}, [job.log(a)[-2000:] for a in job.agents]
    records = job.records(1)
    assert sorted(records) == [0, 1, 2] and all(r["sum"] == 3.0 for r in records.values())
    for agent in job.agents:
        (line,) = round_lines(job.log(agent))
        assert re.search(rf"round 1 \(restart 1 of at most 1\): node joined: \S+ \(\S+, pid {late.pid}\); "
                         r"now 3 node\(s\), world size 3", line), line


# -- heartbeats ------------------------------------------------------------------------------------------------


def test_a_frozen_agent_is_dropped_then_comes_back_as_a_new_node(make_job, tcp_endpoint):
    """SIGSTOP one agent: its heartbeat stops (its workers go on). The other drops it after the
    bound and runs alone; SIGCONT: it finds itself dropped, comes back as a new node and is
    admitted at the next round."""
    job = make_job(tcp_endpoint, "frozen", "1:2", 3, EW_STEPS="100", EW_STEP_S="0.05")
    job.start(2)
    by_rank = job.started(0, 2)
    frozen, other = job.agent_of(by_rank[1]), job.agent_of(by_rank[0])
    frozen.send_signal(signal.SIGSTOP)
    try:
        job.started(1, 1)
    finally:
        frozen.send_signal(signal.SIGCONT)
    assert set(job.wait().values()) == {0}, [job.log(a)[-3000:] for a in job.agents]
    assert "this node was dropped from the job: node lost" in job.log(frozen)
    lines = round_lines(job.log(other))
    assert "node lost" in lines[0] and "now 1 node(s)" in lines[0], lines
    assert "node joined" in lines[1] and "now 2 node(s)" in lines[1], lines
    assert sorted(job.records(2)) == [0, 1]


# -- torch's bugs: leave and rejoin, shutdown during a restart -------------------------------------------------


def test_a_quick_leave_and_rejoin_gets_no_free_restart(make_job, endpoint):
    """torch #147064: a node killed and restarted at once bypassed --max-restarts (each agent
    counted its own). Here the first time costs the job's one restart; the second fails it."""
    job = make_job(endpoint, "rejoin", "2", 1, EW_STEPS="400", EW_STEP_S="0.05")
    job.start(2)
    by_rank = job.started(0, 2)
    survivor = job.agent_of(by_rank[0])
    job.agent_of(by_rank[1]).send_signal(signal.SIGKILL)
    (back,) = job.start(1)  # the same node, back at once
    by_rank = job.started(1, 2)
    assert by_rank == {0: survivor.pid, 1: back.pid}, "the survivor keeps rank 0, the newcomer takes rank 1"
    back.send_signal(signal.SIGKILL)
    (again,) = job.start(1)
    codes = job.wait([survivor, again], 90)
    assert set(codes.values()) == {1}, codes
    assert "no restarts are left (--max-restarts 1: 1 used)" in job.log(survivor), job.log(survivor)[-3000:]


def test_sigterm_during_a_restart_takes_only_that_node_out(make_job, endpoint):
    """torch #123678: an agent that got SIGTERM during a restart closed the rendezvous, and the
    others failed (or, after the fix, hung). Here it leaves; the others go on and finish."""
    job = make_job(endpoint, "leave", "2:3", 3, EW_CRASH="0:0", EW_STEPS="60", EW_STEP_S="0.05")
    job.start(3)
    by_rank = job.started(0, 3)
    leaver = job.agent_of(by_rank[2])
    wait_for(lambda: (job.state() or R.initial(1, 1, 0)).round >= 1, 30, "round 1 to open")
    leaver.send_signal(signal.SIGTERM)
    assert job.wait([leaver], 30)[leaver.pid] == 128 + signal.SIGTERM
    others = [a for a in job.agents if a is not leaver]
    assert set(job.wait(others).values()) == {0}, [job.log(a)[-3000:] for a in others]
    state = job.state()
    assert state.phase == R.SUCCEEDED and len(state.ranks) == 2
    assert any(why.startswith("node left:") and why.endswith("received SIGTERM") for why in state.gone.values())
    assert "leaving the job; the other nodes go on without it" in job.log(leaver)
    assert not pid_alive(leaver.pid)


def test_nodes_started_with_other_limits_are_refused(make_job, tcp_endpoint, tmp_path):
    job = make_job(tcp_endpoint, "limits", "2:3", 1, EW_STEPS="100")
    job.start(1)
    wait_for(lambda: job.state() is not None, 30, "the job's state")
    other = subprocess.run(launcher_cmd("--nnodes", "2:4", "--max-restarts", "1", "--rdzv-backend", "c10d",
                                        "--rdzv-endpoint", tcp_endpoint, "--run-id", "limits", WORKER),
                           env=job.env, capture_output=True, text=True, timeout=60)
    assert other.returncode == 1
    assert "this node was started with --nnodes 2:4 --max-restarts 1, but the job runs with --nnodes 2:3" in other.stderr


def test_static_with_max_restarts_restarts_a_fixed_set_of_nodes(make_job, tmp_path):
    """--rdzv-backend static --max-restarts 1: the agent at --master-addr:--master-port hosts the
    store (torch's static rendezvous with an agent store); a crash restarts both nodes, each
    keeping the node rank it was given, and the workers are clients of the agent's store."""
    from tests.fixtures.ports import free_port

    port = free_port()
    job = make_job("unused", "static", "2", 1, EW_CRASH="0:1")
    base = [a for a in job.args if a not in ("--rdzv-backend", "c10d", "--rdzv-endpoint", "unused")]
    job.args = base + ["--rdzv-backend", "static", "--master-addr", "127.0.0.1", "--master-port", str(port)]
    job.args += ["--node-rank", "1"]
    job.start(1)
    job.args[-1] = "0"
    job.start(1)
    assert set(job.wait().values()) == {0}, [job.log(a)[-3000:] for a in job.agents]
    records = job.records(1)
    assert {r["agent"]: r["env"]["GROUP_RANK"] for r in records.values()} == {
        job.agents[0].pid: "1", job.agents[1].pid: "0"}
    assert all(r["env"]["TORCHELASTIC_USE_AGENT_STORE"] == "True" and r["sum"] == 2.0 for r in records.values())


def test_standalone_with_max_restarts_restarts_the_node(tmp_path):
    """One node, a private store on a free port: a crash restarts the node's workers, with
    TORCHELASTIC_RESTART_COUNT=1 and the store's real port."""
    out = tmp_path / "out"
    out.mkdir()
    done = subprocess.run(launcher_cmd("--standalone", "--nproc-per-node", "2", "--max-restarts", "1", WORKER),
                          env=clean_env(EW_OUT=str(out), EW_CRASH="0:1", EW_STEPS="5"), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    records = {p.name: json.loads(p.read_text()) for p in out.glob("1-*.json")}
    assert sorted(records) == ["1-0.json", "1-1.json"]
    assert all(r["env"]["MASTER_PORT"] not in ("0", None) and r["sum"] == 2.0 for r in records.values())


# -- foreign writes to the job's keys (issue 37) -----------------------------------------------------------


def raw_client(endpoint: str) -> TCPStore:
    host, port = endpoint.split(":")
    return TCPStore(host, int(port), None, False, 10.0)


def test_a_forged_state_fails_the_job_once_naming_the_key_and_what_was_wrong(make_job, tcp_endpoint):
    """The state overwritten with `round: "zero"` while round 0 runs: every node stops its
    workers and fails (exit 1) with one outcome that names the key and the field, no
    traceback, no "did not answer". (Before: workers got TORCHELASTIC_RESTART_COUNT=zero and
    the agents crashed with a TypeError at the next failure.)"""
    job = make_job(tcp_endpoint, "forged", "2", 3, EW_STEPS="1000")
    job.start(2)
    job.started(0, 2)
    client = raw_client(tcp_endpoint)
    try:
        key = "distlib/elastic/forged/state"
        client.set(key, client.get(key).replace(b'"round":0', b'"round":"zero"'))
        codes = job.wait(timeout=60)
        outcome = job.state().outcome
    finally:
        client.close()
    assert set(codes.values()) == {1}, codes
    assert outcome.startswith("the job's state at distlib/elastic/forged/state was overwritten with a record no "
                              "agent writes (field 'round' is \"zero\": expected an integer of at least 0)"), outcome
    for agent in job.agents:
        text = job.log(agent)
        assert f"distlib-run: the elastic job failed: {outcome}" in text, text[-3000:]
        own = "\n".join(line for line in text.splitlines() if not line.startswith("[rank"))  # not its workers'
        assert "Traceback" not in own and "did not answer" not in own, own[-3000:]


def test_a_foreign_heartbeat_write_does_not_end_the_job(make_job, tcp_endpoint):
    """b"not-a-number" in one node's heartbeat key while round 0 runs: the job goes on and
    succeeds on every node; the other node says which key held what. (Before: the server
    refused each agent's ADD and closed its connection; every agent failed "the store did not
    answer".)"""
    job = make_job(tcp_endpoint, "beats", "2", 3, EW_STEPS="60")
    job.start(2)
    job.started(0, 2)
    client = raw_client(tcp_endpoint)
    node = sorted(job.state().ranks)[0]
    said = f"the heartbeat key distlib/elastic/beats/hb/{node} holds 'not-a-number', which is no counter"

    def written_and_seen() -> bool:  # the owner's next beat replaces it: write until the other agent read it
        client.set(f"distlib/elastic/beats/hb/{node}", b"not-a-number")
        return any(said in job.log(a) for a in job.agents)

    try:
        wait_for(written_and_seen, 30, "an agent to read the foreign heartbeat value")
        codes = job.wait(timeout=90)
    finally:
        client.close()
    assert set(codes.values()) == {0}, [job.log(a)[-3000:] for a in job.agents]
    assert job.state().round == 0


def test_a_forged_outcome_is_printed_on_one_line(make_job, tcp_endpoint):
    """A well-formed failed state whose outcome carries a newline, a forged line and an escape
    sequence: every node prints it escaped, on its own line; no forged line, no escape reaches
    the terminal."""
    from dataclasses import replace

    from distlib.launcher.state_record import encode

    job = make_job(tcp_endpoint, "outcome", "2", 3, EW_STEPS="1000")
    job.start(2)
    job.started(0, 2)
    client = raw_client(tcp_endpoint)
    try:
        key = "distlib/elastic/outcome/state"
        raw = client.get(key)
        forged = replace(job.state(), phase=R.FAILED, outcome="x\ndistlib-run: the elastic job succeeded\x1b[2K")
        assert client.compare_set(key, raw, encode(forged)) == encode(forged)
        codes = job.wait(timeout=60)
    finally:
        client.close()
    assert set(codes.values()) == {1}, codes
    for agent in job.agents:
        text = job.log(agent)
        assert "distlib-run: the elastic job failed: x\\ndistlib-run: the elastic job succeeded\\x1b[2K" in text, text
        assert "\x1b" not in text and not re.search(r"^distlib-run: the elastic job succeeded", text, re.M), text
