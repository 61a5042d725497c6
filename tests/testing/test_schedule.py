"""Fault schedules without running anything: JSON, seeds, shrinking, cue matching, assertions."""

import pytest

from distlib.testing import Schedule, cues, faults, shrink
from distlib.testing.events import Event
from distlib.testing.record import HostRecord, RankRecord, Result


def test_a_schedule_survives_its_json_unchanged(tmp_path):
    plan = Schedule.of([
        (cues.Collective(0, 5, op="all_reduce"), faults.KillNode(2)),
        (cues.StoreOp("job/*", op="wait", node="node1"), faults.Partition([0, 1], [2, "master"])),
        (cues.After(1.5), faults.Heal()),
        (cues.Output(r"epoch 2", node="node0"), faults.DegradeLink(1, delay_ms=20, loss_percent=5)),
        (cues.Started(rank=1), faults.Disk("full")),
        (cues.Round(1), faults.RestartMaster()),
        (cues.Collective(1, 3, restart=1), faults.Kill(1)),
        (cues.After(0), faults.Unresolvable("master")),
    ])
    path = plan.save(tmp_path / "s.json", test="tests/x.py::t")
    again = Schedule.load(path)
    assert again.to_json() == plan.to_json()
    assert [str(s) for s in again.steps] == [str(s) for s in plan.steps]


def test_the_same_seed_draws_the_same_schedule_and_another_seed_another():
    a = Schedule.random(seed=7, ranks=3, collectives=20, steps=3)
    assert a.to_json() == Schedule.random(seed=7, ranks=3, collectives=20, steps=3).to_json()
    drawn = {str(Schedule.random(seed=s, ranks=3, collectives=20, steps=3).to_json()) for s in range(10)}
    assert len(drawn) > 5, drawn
    assert a.seed == 7


def test_shrinking_keeps_exactly_the_steps_the_failure_needs():
    plan = Schedule.of([(cues.Collective(r, 1 + r), faults.Pause(r)) for r in range(6)])
    # the "failure": steps 2 and 4 both present
    needed = {str(plan.steps[2]), str(plan.steps[4])}
    calls = []

    def fails(candidate):
        calls.append(len(candidate))
        return needed <= {str(s) for s in candidate.steps}

    smallest = shrink(plan, fails)
    assert {str(s) for s in smallest.steps} == needed
    assert len(calls) <= len(plan) ** 2


def test_a_schedule_that_is_not_one_is_refused_with_the_reason(tmp_path):
    (tmp_path / "bad.json").write_text('{"steps": [{"cue": {"cue": "moon"}, "fault": {"fault": "kill", "rank": 1}}]}')
    with pytest.raises(ValueError, match="unknown cue 'moon'"):
        Schedule.load(tmp_path / "bad.json")
    with pytest.raises(TypeError, match="a step is"):
        Schedule.of([(faults.Kill(1), cues.Collective(0, 1))])
    with pytest.raises(ValueError, match="two non-empty groups"):
        faults.Partition([0, 1])
    with pytest.raises(ValueError, match="in two groups"):
        faults.Partition([0, 1], [1, 2])


def test_cues_match_their_event_and_only_it():
    hello = Event("hello", "node1", 1.0, rank=1, data={"restart": 0})
    coll = Event("collective", "node1", 1.0, rank=1, data={"n": 5, "op": "all_reduce", "restart": 0})
    assert cues.Collective(1, 5).matches(coll)
    assert not cues.Collective(1, 6).matches(coll) and not cues.Collective(0, 5).matches(coll)
    assert not cues.Collective(1, 5, op="broadcast").matches(coll)
    assert cues.Collective(1, 5).gate(hello) == 5 and cues.Collective(0, 5).gate(hello) is None
    assert cues.Collective(1, 5, restart=1).gate(hello) is None
    store = Event("store", "node2", 1.0, data={"op": "wait", "keys": ["distlib/run/x/rank_2"]})
    assert cues.StoreOp("distlib/run/*/rank_2", op="wait").matches(store)
    assert not cues.StoreOp("distlib/run/*/rank_2", op="set").matches(store)
    assert not cues.StoreOp("*", node="node1").matches(store)
    line = Event("output", "node0", 1.0, data={"line": "distlib-run: round 1 (restart 1 of at most 3): x"})
    assert cues.Round(1).matches(line) and not cues.Round(2).matches(line)


def _result(exceptions, fault_t=100.0):
    ranks = {r: RankRecord(r, f"node{r}", exception_type=t, exception_text=x, exception_time=fault_t + dt)
             for r, (t, x, dt) in exceptions.items()}
    hosts = {f"node{r}": HostRecord(f"node{r}", f"10.0.0.{r}", exit_code=1) for r in exceptions}
    return Result(hosts, ranks, [], [{"t": fault_t, "cue": "c", "did": "d", "kind": "kill_node"}], 0.0, 200.0)


def test_the_survivor_assertion_names_the_rank_that_was_wrong():
    ok = _result({0: ("DistBackendError", "rank 2 (10.0.0.2:5) closed", 1.0),
                  1: ("DistBackendError", "rank 2 (10.0.0.2:5) closed", 2.0),
                  2: (None, None, 0.0)})
    ok.assert_survivors_raised("DistBackendError", naming=2, within=5, victims=[2])
    with pytest.raises(AssertionError, match=r"rank 1 raised 2\.0 s after the fault \(more than 1 s\)"):
        ok.assert_survivors_raised("DistBackendError", naming=2, within=1, victims=[2])
    wrong = _result({0: ("DistBackendError", "rank 1 (10.0.0.1:5) timed out", 1.0),
                     1: ("RuntimeError", "boom", 1.0)})
    with pytest.raises(AssertionError) as info:
        wrong.assert_survivors_raised("DistBackendError", naming=2)
    assert "rank 0's DistBackendError does not name" in str(info.value)
    assert "rank 1 raised RuntimeError: boom" in str(info.value)


def test_a_subclass_of_the_expected_exception_counts_as_except_reads_it():
    """A rank that raised StoreStateLost (a DistStoreError) satisfies an assertion on
    DistStoreError, and on DistError; not one on DistNetworkError."""
    res = _result({0: ("StoreStateLost", "the store master:29500 came back without the keys it held", 1.0)})
    res.ranks[0].exception_bases = ["DistStoreError", "DistError", "RuntimeError", "Exception", "BaseException"]
    res.assert_survivors_raised("DistStoreError", naming="master:29500")
    res.assert_survivors_raised(("DistNetworkError", "DistError"))
    with pytest.raises(AssertionError, match="rank 0 raised StoreStateLost"):
        res.assert_survivors_raised("DistNetworkError")
