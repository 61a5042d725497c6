"""The elastic job's state as the store holds it (distlib/launcher/state_record.py): every state
the rounds can reach reads back as itself; anything else is refused with a sentence that names
the field; no record, however written, makes an agent raise anything but that (fuzzed with
hypothesis); texts read from the store are printed with their control characters escaped."""

from __future__ import annotations

import json

import pytest

from distlib.launcher import rounds as R
from distlib.launcher.state_record import RecordError, decode, encode
from distlib.printable import printable

pytest.importorskip("hypothesis", reason="the fuzz needs hypothesis (the test extras)")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

FUZZ = settings(max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
INFO = {n: R.NodeInfo(f"host-{n}", f"10.0.0.{i + 1}", 100 + i, 2, None if i else 0) for i, n in enumerate("abcde")}


def running(max_restarts=3):
    state = R.initial(2, 3, max_restarts)
    for n in "abc":
        state = R.join(state, n, INFO[n])
    return R.close(state)


def record(**change) -> bytes:
    data = json.loads(encode(running()))
    data.update(change)
    return json.dumps(data).encode()


# -- what the agents write reads back ----------------------------------------------------------------


#: One step of a job: a transition with its arguments, as the agents make them.
STEPS = st.one_of(
    st.tuples(st.just("join"), st.sampled_from("abcde")),
    st.tuples(st.just("close"), st.just("")),
    st.tuples(st.just("restart"), st.text(max_size=20)),
    st.tuples(st.just("drop"), st.sampled_from("abcde")),
    st.tuples(st.just("finish"), st.sampled_from("abcde")),
    st.tuples(st.just("fail"), st.text(max_size=20)),
    st.tuples(st.just("outage"), st.tuples(st.floats(0, 2e9), st.floats(0, 1e4))),
)


def apply(state: R.JobState, step) -> R.JobState:
    what, arg = step
    if what == "join":
        return R.join(state, arg, INFO[arg])
    if what == "close":
        return R.close(state) if state.phase == R.JOINING and len(state.joined) >= state.min_nodes else state
    if what == "restart":
        return R.restart(state, state.round, (arg,), 1.5)
    if what == "drop":
        return R.drop(state, arg, f"node lost: {arg}")
    if what == "finish":
        return R.finish_node(state, arg, state.round)
    if what == "outage":
        return R.note_outage(state, R.Outage(state.round, *arg))
    return R.fail(state, arg)


@FUZZ
@given(st.lists(STEPS, max_size=25), st.integers(0, 3))
def test_every_state_the_rounds_reach_reads_back_as_itself(steps, max_restarts):
    state = R.initial(2, 3, max_restarts)
    for step in steps:
        state = apply(state, step)
        read = decode(encode(state))
        assert read == replace_texts(state), (step, state)


def replace_texts(state: R.JobState) -> R.JobState:
    """``state`` as a reader sees it: texts with their control characters escaped."""
    from dataclasses import replace

    return replace(state, causes=tuple(printable(c) for c in state.causes), outcome=printable(state.outcome),
                   history=tuple(replace(r, causes=tuple(printable(c) for c in r.causes)) for r in state.history))


# -- what the agents never write is refused, naming the field ------------------------------------------


@pytest.mark.parametrize("change, words", [
    ({"round": "zero"}, "field 'round' is \"zero\": expected an integer of at least 0"),
    ({"round": 4}, "field 'round' is 4, above 'max_restarts' (3): a job never has more rounds than restarts"),
    ({"round": -1}, "field 'round' is -1: expected an integer of at least 0"),
    ({"round": True}, "field 'round' is true: expected an integer of at least 0"),
    ({"phase": "paused"}, "field 'phase' is \"paused\": expected one of joining, running, succeeded, failed"),
    ({"min": 0}, "field 'min' is 0: expected an integer of at least 1"),
    ({"max": 1}, "field 'max' is 1, below 'min' (2)"),
    ({"max_restarts": 2.5}, "field 'max_restarts' is 2.5: expected an integer of at least 0"),
    ({"ranks": ["a", "a"]}, "field 'ranks' names node(s) a more than once"),
    ({"ranks": ["a", "z"]}, "field 'ranks' names node 'z', which 'nodes' does not describe"),
    ({"done": ["d"]}, "field 'done' names node 'd', which is not in 'ranks'"),
    ({"ranks": []}, "field 'phase' is 'running' but 'ranks' is empty"),
    ({"causes": "start"}, "field 'causes' is \"start\": expected a list of texts"),
    ({"outcome": 7}, "outcome is 7: expected a text"),
    ({"cause_at": float("inf")}, "field 'cause_at' is Infinity: expected a number of seconds >= 0"),
    ({"nodes": {"a": ["host-a", "10.0.0.1", 100, 0, None]}}, "the worker count of node 'a' in 'nodes' is 0"),
    ({"nodes": {"a": ["host-a", "10.0.0.1", 100]}}, "node 'a' in 'nodes' is [\"host-a\", \"10.0.0.1\", 100]"),
    ({"history": [[9, [], ["a"], 2]]}, "'history' records round 9, after the current round 0"),
    ({"outages": [[0, 1.5e9]]}, "entry 0 of 'outages' is [0, 1500000000.0]: expected [round, start, seconds]"),
    ({"outages": [[0, 1.5e9, -1]]}, "the seconds of entry 0 of 'outages' is -1: expected a number of seconds >= 0"),
    ({"outages": [[1, 1.5e9, 3.0]]}, "'outages' records round 1, after the current round 0"),
    ({"outages": [[0, 1.0, 1.0]] * 21}, "expected a list of at most 20 [round, start, seconds]"),
    ({"format": 2}, "format 2, expected 1"),
    ({"extra": 1}, "unknown field(s) extra"),
])
def test_a_record_no_agent_writes_is_refused_naming_the_field(change, words):
    with pytest.raises(RecordError) as caught:
        decode(record(**change))
    assert words in str(caught.value), str(caught.value)


@pytest.mark.parametrize("raw", [b"", b"not json", b"[1, 2]", b"\xff\xfe", b"{" * 100000])
def test_bytes_that_are_no_record_are_refused(raw):
    with pytest.raises(RecordError):
        decode(raw)


def test_an_agent_replaces_a_bad_record_with_a_failed_job_naming_key_and_problem():
    """The one way out of a bad record: decide writes a failed state that says which key held
    what; every agent then finishes with it (exit 1), the job fails once."""
    bad = R.BadRecord("distlib/elastic/job/state", "field 'round' is \"zero\": expected an integer of at least 0")
    view = R.View(now=0.0, silent={}, heartbeat_bound=10, join_timeout=600, last_call_timeout=30,
                  round_opened_at=0.0, limits=R.Limits(2, 3, 3))
    action = R.decide(bad, "a", INFO["a"], view)
    assert action.kind is R.Kind.WRITE and action.state.phase == R.FAILED
    assert "distlib/elastic/job/state" in action.state.outcome and "'round' is \"zero\"" in action.state.outcome
    finish = R.decide(decode(encode(action.state)), "b", INFO["b"], view)
    assert finish.kind is R.Kind.FINISH and finish.status == 1 and finish.text == action.state.outcome


# -- no record makes an agent raise ------------------------------------------------------------------------


JSON = st.recursive(st.none() | st.booleans() | st.integers(-3, 10**20) | st.floats(allow_nan=False) |
                    st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=5),
                    max_leaves=20)
FIELDS = st.sampled_from(["format", "min", "max", "max_restarts", "round", "phase", "joined", "expected", "ranks",
                          "waiting", "done", "nodes", "gone", "causes", "cause_at", "history", "outcome"])


def use(state: R.JobState) -> None:
    """Everything an agent does with a state it read: each node's decision and every text."""
    view = R.View(now=1000.0, silent={n: 5.0 for n in state.nodes}, heartbeat_bound=10, join_timeout=600,
                  last_call_timeout=30, round_opened_at=0.0, min_reached_at=0.0, waiting_since=0.0,
                  running_round=state.round, limits=R.Limits(2, 3, 3),
                  failure=R.WorkerExit(state.round, "worker failed", 2.0))
    for node in list(state.nodes) + ["stranger"]:
        info = state.nodes.get(node, INFO["a"])
        for v in (view, R.View(now=0.0, silent={}, heartbeat_bound=10, join_timeout=600, last_call_timeout=30,
                               round_opened_at=0.0)):
            action = R.decide(state, node, info, v)
            if action.state is not None:
                decode(encode(action.state))
        if node in state.ranks:
            R.round_line(state, node)
    R.rounds_text(state)
    state.world_size()


@FUZZ
@given(st.lists(st.tuples(FIELDS, JSON), min_size=1, max_size=4))
def test_a_fuzzed_record_is_either_refused_or_safe_to_act_on(changes):
    """A valid record with fields overwritten by arbitrary JSON: decode refuses it with a
    RecordError, or every decision and every text made from it runs without an exception."""
    data = json.loads(encode(R.restart(running(), 0, ("worker failed",), 1.0)))
    for name, value in changes:
        data[name] = value
    try:
        state = decode(json.dumps(data).encode())
    except RecordError:
        return
    use(state)


NAMES = st.sampled_from(["a", "b", "c", "d", "e", "z"])
#: Records of the right shape and types, with values anywhere in (and around) their ranges.
TYPED = st.fixed_dictionaries({
    "format": st.just(1), "min": st.integers(1, 4), "max": st.integers(1, 5), "max_restarts": st.integers(0, 3),
    "round": st.integers(0, 3), "phase": st.sampled_from([R.JOINING, R.RUNNING, R.SUCCEEDED, R.FAILED]),
    "joined": st.lists(NAMES, max_size=4, unique=True), "expected": st.lists(NAMES, max_size=4, unique=True),
    "ranks": st.lists(NAMES, max_size=4, unique=True), "waiting": st.lists(NAMES, max_size=3, unique=True),
    "done": st.lists(NAMES, max_size=3, unique=True),
    "nodes": st.dictionaries(NAMES, st.tuples(st.text(max_size=5), st.text(max_size=5), st.integers(0, 9),
                                              st.integers(1, 3), st.none() | st.integers(0, 5)).map(list)),
    "gone": st.dictionaries(NAMES, st.text(max_size=5)), "causes": st.lists(st.text(max_size=5), max_size=3),
    "cause_at": st.floats(0, 100), "outcome": st.text(max_size=10),
    "history": st.lists(st.tuples(st.integers(0, 3), st.lists(st.text(max_size=3), max_size=2),
                                  st.lists(NAMES, max_size=3), st.integers(0, 6)).map(list), max_size=3),
})


@FUZZ
@given(TYPED)
def test_a_well_typed_record_is_either_refused_or_safe_to_act_on(data):
    """Records that pass the type checks, with any relation between their fields: decode
    refuses those no agent could write, and every other one is safe to act on."""
    try:
        state = decode(json.dumps(data).encode())
    except RecordError:
        return
    use(state)


@FUZZ
@given(st.binary(max_size=200))
def test_arbitrary_bytes_are_refused_or_a_state(raw):
    try:
        use(decode(raw))
    except RecordError:
        pass


# -- what is printed ---------------------------------------------------------------------------------------


def test_control_characters_from_the_store_are_escaped():
    """A forged outcome cannot print a line of its own ("the job succeeded") or move the cursor."""
    forged = "crash\ndistlib-run: the elastic job succeeded\x1b[2K\u202e"
    state = decode(record(phase="failed", outcome=forged, causes=["a\rb"]))
    assert state.outcome == "crash\\ndistlib-run: the elastic job succeeded\\x1b[2K\\u202e"
    assert state.causes == ("a\\rb",)
    action = R.decide(state, "a", INFO["a"], R.View(now=0.0, silent={}, heartbeat_bound=10, join_timeout=600,
                                                     last_call_timeout=30, round_opened_at=0.0))
    assert action.kind is R.Kind.FINISH and "\n" not in action.text and "\x1b" not in action.text


def test_printable_leaves_clean_text_alone():
    for text in ("worker failed: rank 3 exited with code 1", "nœud 2 (10.0.0.2) — 東京", "C:\\path"):
        assert printable(text) == text
    assert printable("a\\b\n") == "a\\\\b\\n"
