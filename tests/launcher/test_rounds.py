"""The elastic rendezvous's state machine (distlib/launcher/rounds.py), without processes or a
store: a state and a view in, an action out."""

from __future__ import annotations

import pytest

from distlib.launcher import rounds as R
from distlib.launcher.state_record import decode, encode

INFO = {n: R.NodeInfo(f"host-{n}", f"10.0.0.{i + 1}", 100 + i, 2) for i, n in enumerate("abcde")}


def view(now=0.0, silent=None, running=None, opened=0.0, min_at=None, waiting_since=None, bound=10.0,
         join_timeout=600.0, last_call=30.0, **events):
    return R.View(now=now, silent=silent or {}, heartbeat_bound=bound, join_timeout=join_timeout,
                  last_call_timeout=last_call, round_opened_at=opened, min_reached_at=min_at,
                  waiting_since=waiting_since, running_round=running, **events)


def joined(state, *nodes):
    for n in nodes:
        state = R.join(state, n, INFO[n])
    return state


def running(min_nodes=2, max_nodes=3, max_restarts=3, nodes="abc"):
    return R.close(joined(R.initial(min_nodes, max_nodes, max_restarts), *nodes))


def act(state, node, **kw):
    return R.decide(state, node, INFO[node], view(**kw))


# -- joining and closing -------------------------------------------------------------------------------


def test_a_new_node_joins_the_open_round():
    state = R.initial(2, 3, 0)
    action = act(state, "a")
    assert action.kind is R.Kind.WRITE and action.state.joined == ("a",), action


def test_the_round_closes_at_max_at_once():
    state = joined(R.initial(2, 3, 0), "a", "b", "c")
    action = act(state, "b")
    assert action.kind is R.Kind.WRITE and action.state.phase == R.RUNNING
    assert action.state.ranks == ("a", "b", "c")  # join order
    assert action.state.history[0].world_size == 6


def test_at_min_the_round_waits_for_the_last_call_then_closes():
    state = joined(R.initial(2, 4, 0), "a", "b")
    assert act(state, "a", now=5.0, min_at=0.0).kind is R.Kind.WAIT
    action = act(state, "a", now=30.0, min_at=0.0)
    assert action.kind is R.Kind.WRITE and action.state.phase == R.RUNNING and action.state.ranks == ("a", "b")


def test_below_min_the_round_waits_then_fails_after_the_join_timeout_naming_who_joined():
    state = joined(R.initial(2, 3, 0), "a")
    assert act(state, "a", now=599.0).kind is R.Kind.WAIT
    action = act(state, "a", now=601.0)
    assert action.kind is R.Kind.WRITE and action.state.phase == R.FAILED
    assert "round 0: 1 node(s) joined (host-a (10.0.0.1, pid 100)), fewer than the minimum 2" in action.state.outcome


def test_a_restart_round_closes_as_soon_as_every_survivor_has_joined():
    state = R.restart(running(nodes="abc"), 0, ("worker failed",))
    state = joined(state, "b", "c")
    assert act(state, "c").kind is R.Kind.WAIT  # a is alive and expected
    state = R.drop(state, "a", "node lost: host-a: no heartbeat for 11 s")
    action = act(state, "c", now=1.0, min_at=0.5)  # long before the last call
    assert action.kind is R.Kind.WRITE and action.state.phase == R.RUNNING
    assert action.state.causes[0].startswith("node lost: host-a")  # the root cause first
    assert action.state.causes[1] == "worker failed"


def test_the_last_call_does_not_close_a_round_before_an_absent_nodes_heartbeat_has_spoken():
    """Node c is killed; its peers' workers fail at once, and a and b join round 1 a moment
    after c's last beat. With a last call as long as the heartbeat bound (4 s each), the last
    call ran out first and c was named as a straggler after the workers its death made fail
    (a container run on a FileStore). c is judged by its heartbeat first: lost, named first."""
    state = joined(R.restart(running(), 0, ("worker failed: rank 0 on a exited with code 1",), at=100.0), "a", "b")
    quick = dict(now=4.5, opened=0.0, min_at=0.2, bound=4.0, last_call=4.0)
    action = act(state, "a", silent={"a": 0.1, "b": 0.2, "c": 3.9}, heard=frozenset("ab"), **quick)
    assert action.kind is R.Kind.WAIT, f"closed while c's heartbeat was still within the bound: {action}"
    action = act(state, "a", silent={"a": 0.1, "b": 0.2, "c": 4.2}, heard=frozenset("ab"), **quick)
    assert action.kind is R.Kind.WRITE and action.text.startswith("node lost: host-c"), action
    closing = act(action.state, "a", silent={"a": 0.1, "b": 0.2}, heard=frozenset("ab"), **quick)
    assert closing.kind is R.Kind.WRITE and closing.state.phase == R.RUNNING, closing
    assert [c.split(":")[0] for c in closing.state.causes] == ["node lost", "worker failed"], closing.state.causes


def test_the_last_call_closes_without_a_node_that_beats_but_does_not_join():
    state = joined(R.restart(running(), 0, ("worker failed",)), "a", "b")
    quick = dict(now=4.5, opened=0.0, min_at=0.2, bound=4.0, last_call=4.0, silent={"a": 0.1, "b": 0.2, "c": 0.3})
    action = act(state, "a", heard=frozenset("abc"), **quick)
    assert action.kind is R.Kind.WRITE and action.state.phase == R.RUNNING, action
    assert action.state.causes[0].startswith("node did not come back: host-c"), action.state.causes
    assert act(state, "a", heard=frozenset("abc"), **{**quick, "now": 4.1}).kind is R.Kind.WAIT  # the last call


def test_a_lost_node_stays_first_when_an_earlier_worker_exit_is_reported_after_it():
    """c's worker exit (t=100.3) opened round 1, then node b was found lost, then a's worker exit
    at t=100.0 is reported: it goes before c's worker exit, and after the lost node."""
    state = R.restart(running(), 0, ("worker failed: rank 4 on c",), at=100.3)
    state = R.drop(state, "b", "node lost: host-b: no heartbeat for 4 s")
    late = R.restart(state, 0, ("worker failed: rank 0 on a",), at=100.0)
    assert late.causes == ("node lost: host-b: no heartbeat for 4 s", "worker failed: rank 0 on a",
                           "worker failed: rank 4 on c"), late.causes


def test_a_joining_node_is_told_to_stop_workers_of_the_old_round_first():
    state = R.restart(running(), 0, ("worker failed",))
    assert act(state, "b", running=0).kind is R.Kind.STOP


# -- node ranks ------------------------------------------------------------------------------------------


def test_ranks_stay_where_they_can_and_the_lost_rank_is_refilled():
    """Node a (rank 0) is lost: b keeps rank 1, c (rank 2 no longer exists) takes rank 0 — the
    case of torch #182221, where a node moving to rank 0 crashed the rendezvous."""
    state = running(nodes="abc")
    state = R.drop(state, "a", "node lost")
    state = R.close(joined(state, "c", "b"))
    assert state.ranks == ("c", "b")
    assert state.first_rank("c") == 0 and state.world_size() == 4


def test_hints_are_used_in_the_first_round():
    state = R.initial(3, 3, 0)
    for n, hint in (("a", 2), ("b", None), ("c", 0)):
        state = R.join(state, n, R.NodeInfo(n, "x", 1, 1, hint))
    assert R.close(state).ranks == ("c", "b", "a")


def test_assign_ranks_keeps_previous_over_hints():
    assert R.assign_ranks(["x", "y"], previous=["y", "x"], hints={"x": 0, "y": 1}) == ("y", "x")


# -- restarts ----------------------------------------------------------------------------------------


def test_the_restart_count_is_the_jobs_and_max_restarts_is_job_wide():
    """torch #108158: every node sees the same count; a crash on one node uses the job's budget."""
    state = running(max_restarts=2)
    for expected_round in (1, 2):
        state = R.restart(state, state.round, ("worker failed: rank 2 exited with code 3",))
        assert state.round == expected_round and state.phase == R.JOINING
        state = R.close(joined(state, "a", "b", "c"))
    state = R.restart(state, 2, ("worker failed: rank 2 exited with code 3",))
    assert state.phase == R.FAILED
    assert "no restarts are left (--max-restarts 2: 2 used)" in state.outcome
    lines = R.rounds_text(state)
    assert [line.split(":")[0] for line in lines] == ["round 0", "round 1", "round 2"]
    assert lines[0].startswith("round 0: start -> 3 node(s), world size 6")
    assert lines[1].startswith("round 1: worker failed: rank 2 exited with code 3 -> 3 node(s)")


def test_a_second_report_of_the_same_failure_does_not_restart_twice():
    state = running()
    first = R.restart(state, 0, ("worker failed on a",))
    assert R.restart(first, 0, ("worker failed on b",)) is first
    again = R.drop(first, "c", "node lost")
    assert again.round == 1


def test_the_worker_that_exited_first_is_the_cause_whichever_node_reported_first():
    """A crash of rank 2 on node a (exit at t=100.0) makes rank 4 on node c fail at t=100.3;
    node c's agent looks first. The round's cause must still be rank 2, then rank 4."""
    state = running()
    first = R.restart(state, 0, ("worker failed: rank 4 on c exited with code 1",), at=100.3)
    assert first.round == 1 and first.causes == ("worker failed: rank 4 on c exited with code 1",)
    late = R.restart(first, 0, ("worker failed: rank 2 on a exited with code 3",), at=100.0)
    assert late.round == 1 and late.phase == R.JOINING, "a second report must not restart twice"
    assert late.causes == ("worker failed: rank 2 on a exited with code 3",
                           "worker failed: rank 4 on c exited with code 1"), late.causes
    closed = R.close(joined(late, "a", "b", "c"))
    assert R.rounds_text(closed)[1].startswith("round 1: worker failed: rank 2 on a exited with code 3; "
                                               "worker failed: rank 4 on c"), R.rounds_text(closed)
    # an exit later than the cause changes nothing; nor does any report for another round
    assert R.restart(late, 0, ("worker failed: rank 5 on c",), at=100.5) is late
    assert R.restart(late, 1, ("worker failed: rank 0 on b",), at=99.0).causes == late.causes


def test_a_lost_node_stays_the_cause_when_a_worker_failure_is_reported_after_it():
    """A node lost is not a worker's exit (no time): the workers that failed because of it do
    not take its place, whenever they exited."""
    lost = R.drop(running(), "c", "node lost: host-c: no heartbeat for 11 s")
    assert R.restart(lost, 0, ("worker failed: rank 0 on a",), at=1.0).causes == lost.causes


def test_the_failure_that_ends_the_job_names_the_worker_that_exited_first():
    state = running(max_restarts=0)
    failed = R.restart(state, 0, ("worker failed: rank 4 on c exited with code 1",), at=50.4)
    assert failed.phase == R.FAILED and failed.outcome.startswith("worker failed: rank 4")
    amended = R.restart(failed, 0, ("worker failed: rank 2 on a exited with code 3",), at=50.1)
    assert amended.phase == R.FAILED
    assert amended.outcome.startswith("worker failed: rank 2 on a exited with code 3; worker failed: rank 4 on c"), \
        amended.outcome
    assert amended.outcome.endswith("no restarts are left (--max-restarts 0: 0 used)"), amended.outcome
    assert decode(encode(amended)) == amended


def test_a_node_that_leaves_and_comes_back_at_once_costs_a_restart():
    """torch #147064: a quick leave-and-rejoin must not bypass --max-restarts. The new agent is
    a new node; the old one's silence (or its workers' failures) restarts the job, counted."""
    state = running(max_restarts=0)
    state = R.join(state, "d", INFO["d"])  # c's agent, restarted at once, is a new node
    assert state.waiting == ("d",) and state.round == 0
    # no restarts left: the newcomer does not restart the job by itself
    assert act(state, "a", running=0).kind is R.Kind.KEEP
    action = act(state, "a", running=0, silent={"c": 12.0})
    assert action.kind is R.Kind.WRITE and action.state.phase == R.FAILED
    assert "node lost: host-c (10.0.0.3, pid 102): no heartbeat for 12 s" in action.state.outcome


def test_a_late_node_is_admitted_at_the_next_round_when_there_is_room():
    state = running(nodes="ab")
    state = R.join(state, "c", INFO["c"])
    action = act(state, "a", running=0)
    assert action.kind is R.Kind.WRITE and action.state.round == 1
    assert action.state.causes == ("node joined: host-c (10.0.0.3, pid 102)",)
    assert set(action.state.expected) == {"a", "b", "c"}


def test_a_late_node_waits_while_the_round_is_full_and_times_out():
    state = R.join(running(max_nodes=3), "d", INFO["d"])
    assert act(state, "a", running=0).kind is R.Kind.KEEP
    assert act(state, "d", now=10.0, waiting_since=0.0).kind is R.Kind.WAIT
    action = act(state, "d", now=700.0, waiting_since=0.0)
    assert action.kind is R.Kind.FINISH and action.status == 1 and "the most nodes allowed (3)" in action.text


def test_a_lost_node_restarts_the_running_round():
    state = running()
    action = act(state, "b", running=0, silent={"a": 10.5, "c": 1.0})
    assert action.kind is R.Kind.WRITE and action.state.round == 1
    assert action.state.expected == ("b", "c") and "a" in action.state.gone


def test_silence_below_the_bound_is_not_a_loss():
    assert act(running(), "b", running=0, silent={"a": 9.9}).kind is R.Kind.KEEP


def test_a_dropped_node_that_is_alive_after_all_rejoins_as_a_new_node():
    state = R.drop(running(), "a", "node lost: no heartbeat for 11 s")
    action = act(state, "a", running=0)
    assert action.kind is R.Kind.REJOIN and "no heartbeat for 11 s" in action.text


def test_a_node_that_leaves_during_a_restart_does_not_close_the_rendezvous():
    """torch #123678: a node's shutdown during a restart closed the rendezvous for everyone.
    Here it only takes that node out; the others close the round without it."""
    state = R.restart(running(), 0, ("worker failed",))
    state = joined(state, "a", "b")
    state = R.drop(state, "c", "node left: host-c received SIGTERM")
    action = act(state, "a")
    assert action.kind is R.Kind.WRITE and action.state.phase == R.RUNNING and action.state.ranks == ("a", "b")


# -- the end ----------------------------------------------------------------------------------------------


def test_the_job_succeeds_when_every_node_of_the_round_finished():
    state = running(nodes="ab")
    state = R.finish_node(state, "a", 0)
    assert state.phase == R.RUNNING and act(state, "a", running=0).kind is R.Kind.FINISH
    state = R.finish_node(state, "b", 0)
    assert state.phase == R.SUCCEEDED
    assert act(state, "b").kind is R.Kind.FINISH and act(state, "b").status == 0


def test_a_failure_after_a_node_finished_fails_the_job():
    state = R.finish_node(running(nodes="ab"), "a", 0)
    state = R.restart(state, 0, ("worker failed: rank 2",))
    assert state.phase == R.FAILED and "after node(s) host-a" in state.outcome


def test_a_failed_job_finishes_every_node_with_its_outcome():
    state = R.fail(running(), "why")
    action = act(state, "c", running=0)
    assert action.kind is R.Kind.FINISH and action.status == 1 and action.text == "why"


def test_a_node_waiting_when_the_job_ends_exits_cleanly():
    state = R.join(running(nodes="ab", max_nodes=2), "c", INFO["c"])
    state = R.finish_node(R.finish_node(state, "a", 0), "b", 0)
    action = act(state, "c")
    assert action.kind is R.Kind.FINISH and action.status == 0 and "before this node was admitted" in action.text


def test_a_node_with_other_limits_is_told_which():
    text = R.config_mismatch(R.initial(2, 3, 1), 2, 4, 1)
    assert "--nnodes 2:4 --max-restarts 1, but the job runs with --nnodes 2:3 --max-restarts 1" in text
    assert R.config_mismatch(R.initial(2, 3, 1), 2, 3, 1) is None


def test_the_restart_line_names_round_cause_and_world():
    state = R.close(joined(R.drop(running(), "a", "node lost: host-a"), "b", "c"))
    line = R.round_line(state, "c")
    assert line.startswith("round 1 (restart 1 of at most 3): node lost: host-a; now 2 node(s), world size 4")


def test_a_round_closed_without_an_expected_node_says_so():
    state = joined(R.restart(running(), 0, ("worker failed",)), "a", "b")
    state = R.close(state)
    assert state.causes[0] == "node did not come back: host-c (10.0.0.3, pid 102) (not in round 1 by its last call)"
    assert state.history[-1].causes == state.causes


# -- one door: the agent's own events reach the store only through decide ------------------------------


LIMITS = R.Limits(2, 3, 3)


def test_no_state_yet_is_created_with_the_agents_limits():
    action = R.decide(None, "a", INFO["a"], view(limits=LIMITS))
    assert action.kind is R.Kind.WRITE and action.state == R.initial(2, 3, 3)


def test_a_worker_failure_is_written_as_the_next_round_then_the_workers_stop():
    state = running()
    failure = R.WorkerExit(0, "worker failed: rank 1 exited with code 3", 12.5)
    action = act(state, "a", running=0, failure=failure)
    assert action.kind is R.Kind.WRITE and action.state.round == 1 and action.state.causes == (failure.cause,)
    assert action.state.cause_at == 12.5
    assert act(action.state, "a", running=0, failure=failure).kind is R.Kind.STOP  # reported once


def test_a_failure_that_exited_first_amends_a_failed_jobs_outcome():
    failed = R.restart(running(max_restarts=0), 0, ("worker failed: rank 4 on c",), at=50.4)
    earlier = R.WorkerExit(0, "worker failed: rank 0 on a", 50.1)
    action = act(failed, "a", running=0, failure=earlier)
    assert action.kind is R.Kind.WRITE and action.state.outcome.startswith("worker failed: rank 0 on a; worker")
    later = R.WorkerExit(0, "worker failed: rank 1 on a", 50.9)
    assert act(failed, "a", running=0, failure=later).kind is R.Kind.FINISH


def test_workers_done_are_written_as_the_node_finished():
    action = act(running(), "b", running=0, finished=True)
    assert action.kind is R.Kind.WRITE and action.state.done == ("b",)
    assert act(action.state, "b", running=0, finished=True).kind is R.Kind.FINISH


def test_a_signal_writes_the_nodes_leave_then_it_exits():
    leaving = R.Leaving("node left: host-b received SIGTERM", 143)
    action = act(running(), "b", leaving=leaving)
    assert action.kind is R.Kind.WRITE and action.state.gone == {"b": leaving.why} and action.state.round == 1
    done = act(action.state, "b", leaving=leaving)
    assert done.kind is R.Kind.LEAVE and done.status == 143


def test_the_agent_writes_only_what_decide_made():
    """elastic_agent.py calls no transition of rounds.py and writes the state in one place, with
    the state of decide's action (issue 35: one door for elastic transitions)."""
    import ast
    from pathlib import Path

    import distlib.launcher.elastic_agent as agent

    tree = ast.parse(Path(agent.__file__).read_text())
    transitions = {"initial", "join", "close", "fail", "restart", "drop", "finish_node", "failed_record"}
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)]
    called = {c.func.attr for c in calls if isinstance(c.func.value, ast.Name) and c.func.value.id == "R"}
    assert not called & transitions, f"the agent makes states itself: {sorted(called & transitions)}"
    writes = [ast.unparse(c) for c in calls if c.func.attr in ("write", "update", "compare_set", "set", "add")]
    assert writes == ["rounds.write(raw, action.state)"], writes


# -- the store away: ridden out, recorded once --------------------------------------------------------


def test_an_absence_of_the_store_is_recorded_once_whichever_nodes_saw_it():
    """Three agents saw the master away, each on its own clock and polling: one record, the span
    of their sightings; a later absence is a second record."""
    state = running()
    first = R.note_outage(state, R.Outage(0, 1000.0, 5.0))
    assert first.outages == (R.Outage(0, 1000.0, 5.0),) and first.round == 0 and first.phase == R.RUNNING
    both = R.note_outage(first, R.Outage(0, 1000.4, 5.3))
    assert both.outages == (R.Outage(0, 1000.0, pytest.approx(5.7)),), both.outages
    assert R.note_outage(both, R.Outage(0, 1001.0, 2.0)) is both and R.outage_noted(both, R.Outage(0, 1001.0, 2.0))
    again = R.note_outage(both, R.Outage(0, 2000.0, 1.0))
    assert [o.started for o in again.outages] == [1000.0, 2000.0]


def test_a_node_back_from_the_stores_absence_records_it_and_goes_on_in_the_same_round():
    state = running()
    away = R.Outage(0, 1000.0, 5.0)
    action = act(state, "a", running=0, outage=away)
    assert action.kind is R.Kind.WRITE and action.state.outages == (away,), action
    assert action.state.round == 0 and action.state.phase == R.RUNNING, "no restart for an absence ridden out"
    assert act(action.state, "a", running=0, outage=away).kind is R.Kind.KEEP
    assert R.rounds_text(action.state)[-1].startswith("the store was away for 5.0 s in round 0 (from 1970-01-01 "
                                                      "00:16:40 UTC): the job went on in the same round")
