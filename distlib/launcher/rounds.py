"""The elastic rendezvous as a pure state machine: a job's state and one agent's view in, an
action out. No store, no processes, no clock: ``rounds_store.py`` keeps the state in a store
(compare_set), ``elastic_agent.py`` acts; this module decides, so every rule is tested here
with plain values (tests/launcher/test_rounds.py).

The job goes through **rounds**, numbered from 0. A round is *joining* (nodes join; late nodes
of a running round wait), then *running* (its nodes have node ranks and run workers), until a
restart opens the next round, or the job *succeeded* (every node of the round finished) or
*failed*. The number of a round is the job's restart count: one counter in the store, the same
for every node and every worker (``TORCHELASTIC_RESTART_COUNT``), so ``--max-restarts`` is a
job-wide limit — a node that leaves and comes back is a new node in a new round, never a reset.

A joining round closes when MAX nodes have joined; or when at least MIN have and either every
node still alive from the previous round (and every late node) has joined, or the last-call
window has passed since MIN was reached — but not while a node expected from the previous round
is absent and has not been heard to beat since the round opened: whether it is alive (then it
"did not come back" by the last call) or lost is its heartbeat's to say, within the bound. A
node killed a moment before the others joined would otherwise be named as a straggler, after
the workers its death made fail, instead of first, as lost. Closing assigns node ranks: a node keeps its rank from
the previous round where that rank still exists, then a node's hint (its ``--node-rank``) is
used where free, then the free ranks go in join order.

Liveness is each agent's own observation (``View.silent``: seconds since it last saw a node's
heartbeat counter move), so no two clocks are ever compared. A node silent for longer than the
bound is dropped: from a running round that is a restart ("node lost"), from a joining round it
is no longer waited for.

The store's absences that the job rode out (a master service that restarted with its journal,
outages.py) are kept too, one record per absence however many nodes saw it (``note_outage``:
sightings that overlap are one), so every node's report can say the store was away, when and
for how long; an absence restarts nothing.

Restart causes are kept per round (the node lost first: it is usually why the workers failed),
and every closed round is recorded, so a failure can list them all. When workers fail on
several nodes, the cause is the worker that **exited first** (each agent reports its worker's
exit time), not the node whose agent looked first: a crash on one node makes its peers' workers
fail a moment later, and naming one of those would send the user to the wrong rank.
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field, replace
from typing import FrozenSet, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

JOINING, RUNNING, SUCCEEDED, FAILED = "joining", "running", "succeeded", "failed"
#: How a cause that is a node's fate begins (a node lost, left, not back, joined): such a cause
#: explains the workers' failures that follow it, so it stays ahead of them.
NODE_CAUSES = ("node lost: ", "node left: ", "node did not come back: ", "node joined: ")


def is_node_cause(cause: str) -> bool:
    return cause.startswith(NODE_CAUSES)


@dataclass(frozen=True)
class NodeInfo:
    """One agent: where it runs and what it brings (its workers, its preferred node rank)."""

    name: str
    addr: str
    pid: int
    nproc: int
    hint: Optional[int] = None

    def describe(self) -> str:
        return f"{self.name} ({self.addr}, pid {self.pid})"


@dataclass(frozen=True)
class RoundRecord:
    """A closed round: why it exists, its nodes in node-rank order, its world size."""

    number: int
    causes: Tuple[str, ...]
    nodes: Tuple[str, ...]
    world_size: int


@dataclass(frozen=True)
class Outage:
    """The rendezvous store away: in round ``round``, from ``started`` (wall clock, seconds since
    the epoch, as the node that saw it reads it) for ``seconds``; the job rode it out."""

    round: int
    started: float
    seconds: float

    @property
    def ended(self) -> float:
        return self.started + self.seconds


#: Two nodes' sightings of one absence of the store differ by their clocks and their polling:
#: sightings this close (seconds) are the same absence.
OUTAGE_SLACK_S = 2.0
#: The most absences a state keeps (the record stays small; the count goes on).
MAX_OUTAGES = 20


@dataclass(frozen=True)
class JobState:
    """The whole job as the store holds it (module docstring)."""

    min_nodes: int
    max_nodes: int
    max_restarts: int
    round: int = 0
    phase: str = JOINING
    #: joining: the nodes that joined this round, in order.
    joined: Tuple[str, ...] = ()
    #: joining (round > 0): the nodes of the previous round believed alive, and late nodes.
    expected: Tuple[str, ...] = ()
    #: running: the round's nodes by node rank; joining: the previous round's (rank stability).
    ranks: Tuple[str, ...] = ()
    #: running: nodes that arrived after the round closed.
    waiting: Tuple[str, ...] = ()
    #: running: nodes of the round whose workers all succeeded.
    done: Tuple[str, ...] = ()
    nodes: Mapping[str, NodeInfo] = field(default_factory=dict)
    #: nodes that left or were lost, and why; a node id is never admitted again.
    gone: Mapping[str, str] = field(default_factory=dict)
    #: why the current round exists (failed: why the job failed).
    causes: Tuple[str, ...] = ("start",)
    #: when the worker exit that is the first of ``causes`` happened (wall clock; 0: no worker's
    #: exit, e.g. a node lost): a report of an earlier exit in the same round goes before it.
    cause_at: float = 0.0
    history: Tuple[RoundRecord, ...] = ()
    #: succeeded/failed: what happened, in words.
    outcome: str = ""
    #: the store's absences the job rode out, the latest MAX_OUTAGES, oldest first.
    outages: Tuple[Outage, ...] = ()

    def describe(self, node: str) -> str:
        info = self.nodes.get(node)
        return info.describe() if info else node

    def world_size(self) -> int:
        return sum(self.nodes[n].nproc for n in self.ranks)

    def first_rank(self, node: str) -> int:
        """The global rank of ``node``'s local rank 0 (nodes may run different numbers of workers)."""
        position = self.ranks.index(node)
        return sum(self.nodes[n].nproc for n in self.ranks[:position])


@dataclass(frozen=True)
class BadRecord:
    """What the store holds at the state's key when it is no state this code could have written
    (state_record.py says why, in ``problem``): a foreign write, another program's key."""

    key: str
    problem: str


@dataclass(frozen=True)
class Limits:
    """One agent's ``--nnodes MIN:MAX`` and ``--max-restarts``: what it creates a job with."""

    min_nodes: int
    max_nodes: int
    max_restarts: int


def initial(min_nodes: int, max_nodes: int, max_restarts: int) -> JobState:
    return JobState(min_nodes=min_nodes, max_nodes=max_nodes, max_restarts=max_restarts)


def failed_record(limits: Optional[Limits], bad: BadRecord) -> JobState:
    """The state that replaces a bad record: the job failed, saying which key held what."""
    limits = limits or Limits(1, 1, 0)
    return fail(initial(limits.min_nodes, limits.max_nodes, limits.max_restarts),
                f"the job's state at {bad.key} was overwritten with a record no agent writes ({bad.problem}): "
                "something else writes to this run's keys (another program, or anyone who reaches the store "
                "without a token); the job cannot trust its rounds any more")


def config_mismatch(state: JobState, min_nodes: int, max_nodes: int, max_restarts: int) -> Optional[str]:
    """Words for a node started with other limits than the job's, or None when they agree."""
    mine = (min_nodes, max_nodes, max_restarts)
    theirs = (state.min_nodes, state.max_nodes, state.max_restarts)
    if mine == theirs:
        return None
    return (f"this node was started with --nnodes {min_nodes}:{max_nodes} --max-restarts {max_restarts}, but the job "
            f"runs with --nnodes {state.min_nodes}:{state.max_nodes} --max-restarts {state.max_restarts}: every "
            "node must be started with the same values")


# -- transitions -----------------------------------------------------------------------------------


def _without(items: Sequence[str], node: str) -> Tuple[str, ...]:
    return tuple(n for n in items if n != node)


def join(state: JobState, node: str, info: NodeInfo) -> JobState:
    """``node`` asks in: into the joining round while there is room, else onto the waiting list."""
    if node in state.gone or state.phase in (SUCCEEDED, FAILED):
        return state
    nodes = {**state.nodes, node: info}
    if state.phase == JOINING:
        if node in state.joined:
            return state
        if len(state.joined) < state.max_nodes:
            return replace(state, joined=state.joined + (node,), waiting=_without(state.waiting, node), nodes=nodes)
    if node in state.ranks and state.phase == RUNNING or node in state.waiting:
        return state
    return replace(state, waiting=state.waiting + (node,), nodes=nodes)


def assign_ranks(members: Sequence[str], previous: Sequence[str], hints: Mapping[str, Optional[int]]) -> Tuple[str, ...]:
    """Node ranks for ``members`` (in join order): the previous rank where it still exists, then
    the hint where free, then the free ranks in join order."""
    size = len(members)
    slots: List[Optional[str]] = [None] * size
    placed = set()
    for node in members:
        if node in previous and previous.index(node) < size:
            slots[previous.index(node)] = node
            placed.add(node)
    for node in members:
        hint = hints.get(node)
        if node not in placed and hint is not None and 0 <= hint < size and slots[hint] is None:
            slots[hint] = node
            placed.add(node)
    rest = iter(n for n in members if n not in placed)
    return tuple(slot if slot is not None else next(rest) for slot in slots)


def close(state: JobState) -> JobState:
    """Close the joining round: node ranks, a history record, running."""
    members = state.joined[:state.max_nodes]
    ranks = assign_ranks(members, state.ranks, {n: state.nodes[n].hint for n in members})
    absent = tuple(f"node did not come back: {state.describe(n)} (not in round {state.round} by its last call)"
                   for n in state.expected if n not in state.joined)
    closed = replace(state, phase=RUNNING, ranks=ranks, joined=(), expected=(), done=(),
                     waiting=state.joined[state.max_nodes:] + state.waiting, causes=absent + state.causes)
    record = RoundRecord(state.round, closed.causes, ranks, closed.world_size())
    return replace(closed, history=state.history + (record,))


def fail(state: JobState, why: str) -> JobState:
    return replace(state, phase=FAILED, outcome=why)


def restart(state: JobState, for_round: int, causes: Sequence[str], at: float = 0.0) -> JobState:
    """The next round, for ``causes`` seen in round ``for_round``; ``at``: when the worker exit
    they describe happened (0: not a worker's exit). No restarts left, or a node already
    finished: the job fails instead. When another node asked first (the round is no longer the
    running one), a no-op — unless it reported a worker exit later than ``at``: then ``causes``
    go first (module docstring)."""
    if state.phase != RUNNING or state.round != for_round:
        return _earlier(state, for_round, tuple(causes), at)
    if state.done or state.round >= state.max_restarts:
        return replace(fail(state, _no_restart(state, "; ".join(causes))), causes=tuple(causes), cause_at=at)
    alive = tuple(n for n in state.ranks if n not in state.gone) + state.waiting
    return replace(state, round=state.round + 1, phase=JOINING, joined=(), expected=alive, waiting=(), done=(),
                   causes=tuple(causes), cause_at=at)


def _no_restart(state: JobState, why: str) -> str:
    """Why a failure in the running round fails the job instead of restarting it."""
    if state.done:
        finished = ", ".join(state.describe(n) for n in state.done)
        return (f"{why} in round {state.round}, after node(s) {finished} had finished their workers "
                "(a round that has begun to finish is not restarted)")
    return (f"{why} in round {state.round}, and no restarts are left "
            f"(--max-restarts {state.max_restarts}: {state.round} used)")


def _earlier(state: JobState, for_round: int, causes: Tuple[str, ...], at: float) -> JobState:
    """A late report for round ``for_round`` of a worker exit at ``at``: first among the causes
    when a worker exit later than it restarted (or failed) that round; otherwise no change."""
    restarted = (state.phase == JOINING and state.round == for_round + 1) or \
                (state.phase == FAILED and state.round == for_round)
    if not (at and state.cause_at and at < state.cause_at and restarted):
        return state
    nodes = tuple(itertools.takewhile(is_node_cause, state.causes))  # a node lost meanwhile stays first
    merged = nodes + causes + tuple(c for c in state.causes[len(nodes):] if c not in causes)
    if state.phase == FAILED:
        return replace(state, causes=merged, cause_at=at, outcome=_no_restart(state, "; ".join(merged)))
    return replace(state, causes=merged, cause_at=at)


def drop(state: JobState, node: str, why: str) -> JobState:
    """``node`` left or was lost (``why`` in words): never waited for again; a running round
    that had it restarts, and a joining round that waited for it records why."""
    if node in state.gone or state.phase in (SUCCEEDED, FAILED):
        return state
    was_member = node in state.ranks or node in state.joined or node in state.expected
    out = replace(state, gone={**state.gone, node: why}, joined=_without(state.joined, node),
                  expected=_without(state.expected, node), waiting=_without(state.waiting, node))
    if state.phase == RUNNING and node in state.ranks and node not in state.done:
        return restart(out, state.round, (why,))
    if state.phase == JOINING and was_member:
        return replace(out, causes=(why,) + state.causes)
    return out


def finish_node(state: JobState, node: str, for_round: int) -> JobState:
    """``node``'s workers of round ``for_round`` all succeeded; the last one ends the job."""
    if state.phase != RUNNING or state.round != for_round or node not in state.ranks or node in state.done:
        return state
    done = state.done + (node,)
    if set(done) >= set(state.ranks):
        return replace(state, done=done, phase=SUCCEEDED,
                       outcome=f"every node of round {state.round} finished ({len(done)} node(s), "
                               f"world size {state.world_size()})")
    return replace(state, done=done)


def note_outage(state: JobState, outage: Outage) -> JobState:
    """Record an absence of the store that a node rode out: merged into a record of the same
    absence (another node's sighting, within OUTAGE_SLACK_S) as the span of both, else added."""
    for i, seen in enumerate(state.outages):
        if outage.started <= seen.ended + OUTAGE_SLACK_S and seen.started <= outage.ended + OUTAGE_SLACK_S:
            started = min(seen.started, outage.started)
            merged = Outage(min(seen.round, outage.round), started, max(seen.ended, outage.ended) - started)
            if merged == seen:
                return state
            return replace(state, outages=state.outages[:i] + (merged,) + state.outages[i + 1:])
    return replace(state, outages=(state.outages + (outage,))[-MAX_OUTAGES:])


def outage_noted(state: JobState, outage: Outage) -> bool:
    """Whether ``state`` holds ``outage`` (or an absence that covers it)."""
    return note_outage(state, outage) == state


# -- one agent's decision ----------------------------------------------------------------------------


@dataclass(frozen=True)
class View:
    """What one agent sees besides the state: its own clock and observations (seconds)."""

    now: float
    #: seconds since this agent last saw each node's heartbeat counter change
    silent: Mapping[str, float]
    heartbeat_bound: float
    join_timeout: float
    last_call_timeout: float
    #: when this agent first saw the current round joining
    round_opened_at: float
    #: when this agent first saw at least MIN nodes in the current round (None: not yet)
    min_reached_at: Optional[float] = None
    #: the nodes whose heartbeat this agent saw move since it saw the current round open
    heard: FrozenSet[str] = frozenset()
    #: when this agent began to wait as a late node (None: it is not waiting)
    waiting_since: Optional[float] = None
    #: the round this agent's workers belong to (None: no workers running)
    running_round: Optional[int] = None
    #: this agent's limits: what it creates the state with (or replaces a bad record with)
    limits: Optional[Limits] = None
    #: the first of this node's workers that failed, while its workers are not yet stopped
    failure: Optional["WorkerExit"] = None
    #: every worker of this node's running round exited 0
    finished: bool = False
    #: this node was told to stop (a signal); its workers are already stopped
    leaving: Optional["Leaving"] = None
    #: an absence of the store this agent rode out and has not seen recorded in the state yet
    outage: Optional[Outage] = None


@dataclass(frozen=True)
class WorkerExit:
    """A worker of this node that failed in round ``round``: ``cause`` in words, and ``at``, when it
    exited (wall clock, to order it against other nodes' reports: module docstring)."""

    round: int
    cause: str
    at: float


@dataclass(frozen=True)
class Leaving:
    """This node was told to stop: ``why`` in words, and the exit status it ends with (128 + N)."""

    why: str
    status: int


class Kind(enum.Enum):
    """What an agent does next (``Action.kind``)."""

    #: put ``Action.state`` in the store (compare_set against what was read), then decide again
    WRITE = "write"
    #: nothing to do yet (``text`` says for what); look again after the monitor interval
    WAIT = "wait"
    #: start this node's workers for the running round
    START = "start"
    #: stop this node's workers (a new round began: ``text`` says why), then decide again
    STOP = "stop"
    #: the workers run in the current round: look at them again after the monitor interval
    KEEP = "keep"
    #: this node was dropped (``text``): stop its workers, come back as a new node
    REJOIN = "rejoin"
    #: the job (or this node's part) is over: exit with ``status``, saying ``text``
    FINISH = "finish"
    #: this node has left the job (the others know): exit with ``status``
    LEAVE = "leave"


@dataclass(frozen=True)
class Action:
    """What the agent does next (``Kind``); ``decide`` is the only maker of the state an agent writes."""

    kind: Kind
    text: str = ""
    state: Optional[JobState] = None
    status: int = 0


def watched(state: JobState) -> Tuple[str, ...]:
    """The nodes whose silence matters now."""
    if state.phase == RUNNING:
        return tuple(n for n in state.ranks if n not in state.done) + state.waiting
    if state.phase == JOINING:
        return tuple(dict.fromkeys(state.joined + state.expected))
    return ()


def _names(state: JobState, nodes: Iterable[str]) -> str:
    return ", ".join(state.describe(n) for n in nodes) or "none"


def _closing(state: JobState, view: View) -> bool:
    joined = len(state.joined)
    if joined >= state.max_nodes:
        return True
    if joined < state.min_nodes:
        return False
    absent = set(state.expected) - set(state.joined)
    if state.expected and not absent:
        return True
    if absent - view.heard:  # alive or lost? its heartbeat says within the bound (module docstring)
        return False
    return view.min_reached_at is not None and view.now - view.min_reached_at >= view.last_call_timeout


def _too_few(state: JobState, view: View) -> str:
    missing = [f"{state.describe(n)}: {why}" for n, why in state.gone.items() if n in state.ranks]
    return (f"round {state.round}: {len(state.joined)} node(s) joined ({_names(state, state.joined)}), fewer than "
            f"the minimum {state.min_nodes}, within the join timeout of {view.join_timeout:g} s; gone from round "
            f"{state.round - 1}: " + ("; ".join(missing) if missing else "none") if state.round else
            f"round 0: {len(state.joined)} node(s) joined ({_names(state, state.joined)}), fewer than the minimum "
            f"{state.min_nodes}, within the join timeout of {view.join_timeout:g} s: start the other nodes with "
            "the same --rdzv-endpoint and --rdzv-id")


def decide(state: Union[JobState, BadRecord, None], node: str, info: NodeInfo, view: View) -> Action:
    """Agent ``node``'s next action (``Kind`` says what each means), for what the store holds
    (None: nothing yet) and what the agent sees. Every write of the job's state comes from here:
    the agent's own events (a worker's exit, its workers' success, a signal) reach it through the
    view."""
    if state is None:
        if view.limits is None:
            return Action(Kind.WAIT, "no job state yet")
        return Action(Kind.WRITE, "creating the job's state", initial(view.limits.min_nodes, view.limits.max_nodes,
                                                                       view.limits.max_restarts))
    if isinstance(state, BadRecord):
        return Action(Kind.WRITE, f"the job's state at {state.key} is not valid: {state.problem}",
                      failed_record(view.limits, state))
    if view.leaving is not None:
        left = drop(state, node, view.leaving.why)
        if left != state:
            return Action(Kind.WRITE, view.leaving.why, left)
        return Action(Kind.LEAVE, view.leaving.why, status=view.leaving.status)
    if view.failure is not None:
        reported = restart(state, view.failure.round, (view.failure.cause,), view.failure.at)
        if reported != state:
            return Action(Kind.WRITE, view.failure.cause, reported)
    if view.outage is not None and state.phase in (JOINING, RUNNING):
        noted = note_outage(state, view.outage)
        if noted != state:
            return Action(Kind.WRITE, f"recording the store's absence ({outage_text(view.outage)})", noted)
    if state.phase == SUCCEEDED:
        if node in state.ranks:
            return Action(Kind.FINISH, f"the job succeeded: {state.outcome}")
        return Action(Kind.FINISH, f"the job finished (round {state.round}) before this node was admitted")
    if state.phase == FAILED:
        return Action(Kind.FINISH, state.outcome, status=1)
    if node in state.gone:
        return Action(Kind.REJOIN, f"this node was dropped from the job: {state.gone[node]}")
    for other in watched(state):
        silent = view.silent.get(other, 0.0)
        if other != node and silent > view.heartbeat_bound:
            why = f"node lost: {state.describe(other)}: no heartbeat for {silent:.0f} s"
            return Action(Kind.WRITE, why, drop(state, other, why))
    if view.finished and view.running_round is not None:
        finished = finish_node(state, node, view.running_round)
        if finished != state:
            return Action(Kind.WRITE, f"this node's workers of round {view.running_round} finished", finished)
    if view.running_round is not None and (state.phase != RUNNING or view.running_round != state.round):
        return Action(Kind.STOP, f"round {state.round} began: {'; '.join(state.causes)}")
    if state.phase == JOINING:
        return _joining(state, node, info, view)
    return _running(state, node, info, view)


def _joining(state: JobState, node: str, info: NodeInfo, view: View) -> Action:
    if node not in state.joined:
        return Action(Kind.WRITE, f"joining round {state.round}", join(state, node, info))
    if _closing(state, view):
        return Action(Kind.WRITE, f"closing round {state.round}", close(state))
    if len(state.joined) < state.min_nodes and view.now - view.round_opened_at > view.join_timeout:
        return Action(Kind.WRITE, "join timeout", fail(state, _too_few(state, view)))
    return Action(Kind.WAIT, f"round {state.round}: {len(state.joined)} of {state.min_nodes}..{state.max_nodes} "
                             f"node(s) joined")


def _running(state: JobState, node: str, info: NodeInfo, view: View) -> Action:
    if node in state.ranks:
        if node in state.done:
            return Action(Kind.FINISH, f"this node's workers of round {state.round} finished")
        if view.running_round != state.round:
            return Action(Kind.START, f"round {state.round}")
        if state.waiting and len(state.ranks) < state.max_nodes and not state.done \
                and state.round < state.max_restarts:
            why = "node joined: " + _names(state, state.waiting)
            return Action(Kind.WRITE, why, restart(state, state.round, (why,)))
        return Action(Kind.KEEP)
    if node not in state.waiting:
        return Action(Kind.WRITE, f"waiting to be admitted after round {state.round}", join(state, node, info))
    if view.waiting_since is not None and view.now - view.waiting_since > view.join_timeout:
        room = ("no restarts are left" if state.round >= state.max_restarts else
                f"it has the most nodes allowed ({state.max_nodes})" if len(state.ranks) >= state.max_nodes else
                "no restart came")
        return Action(Kind.FINISH, f"not admitted within the join timeout of {view.join_timeout:g} s: round "
                                   f"{state.round} runs with {len(state.ranks)} node(s) and {room}", status=1)
    return Action(Kind.WAIT, f"waiting for the next round (round {state.round} runs with {len(state.ranks)} "
                             "node(s))")


# -- words ------------------------------------------------------------------------------------------


def round_line(state: JobState, node: str) -> str:
    """The one line every node prints when a round starts after a restart."""
    rank = state.ranks.index(node)
    return (f"round {state.round} (restart {state.round} of at most {state.max_restarts}): "
            f"{'; '.join(state.causes)}; now {len(state.ranks)} node(s), world size {state.world_size()} "
            f"(this node: node rank {rank}, global ranks {state.first_rank(node)}.."
            f"{state.first_rank(node) + state.nodes[node].nproc - 1})")


def outage_text(outage: Outage) -> str:
    """One absence of the store, for a person: how long, in which round, from when (UTC)."""
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(outage.started))
    return (f"was away for {outage.seconds:.1f} s in round {outage.round} (from {when} UTC): the job went on in "
            "the same round, no restart counted")


def rounds_text(state: JobState) -> List[str]:
    """Every round of the job and its cause, one line each (for a failure and for the report)."""
    lines = []
    for record in state.history:
        names = ", ".join(f"{i}={state.describe(n)}" for i, n in enumerate(record.nodes))
        lines.append(f"round {record.number}: {'; '.join(record.causes)} -> {len(record.nodes)} node(s), world "
                     f"size {record.world_size} (node ranks: {names})")
    if state.phase == JOINING:
        lines.append(f"round {state.round}: {'; '.join(state.causes)} -> never closed")
    lines += [f"the store {outage_text(outage)}" for outage in state.outages]
    return lines
