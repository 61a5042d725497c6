"""One elastic agent's observations between two reads of the job's state, on its own clock, and
the ``rounds.View`` they make.

``rounds.decide`` is pure: it needs to be told how long this agent has seen the current round
open, since when at least MIN nodes have joined, since when this node waits to be admitted,
how long each node's heartbeat has not moved, and what happened to this node's workers and to
the agent itself (a signal), and which nodes it has heard beat since the round opened. The
time the store was away counts for none of them (``store_was_away``). ``Bookkeeping`` keeps
those facts, updates them from each state read and each heartbeat reading, and hands
``decide`` the view. It reads no store and starts no process: the agent (elastic_agent.py)
feeds it.
"""

from __future__ import annotations

from typing import Dict, FrozenSet, Iterable, Optional, Tuple

from . import rounds as R
from .elastic_config import ElasticPlan


class Liveness:
    """When this agent last saw each node's heartbeat counter move, on its own monotonic clock.
    A counter that cannot be read (None: its key holds no counter) is not a move: the node's
    silence goes on counting from when it was first watched. The first sight of a counter is
    no move either: it says nothing of whether the node still beats."""

    def __init__(self) -> None:
        #: node -> (its counter, when this agent saw it move (or first saw it), the reading before
        #: that move: the beat came after it; None while no move was seen)
        self._seen: Dict[str, Tuple[Optional[int], float, Optional[float]]] = {}
        #: node -> when this agent last read its counter
        self._read_at: Dict[str, float] = {}

    def observe(self, counters: Dict[str, Optional[int]], now: float) -> None:
        for node, count in counters.items():
            last = self._seen.get(node)
            if last is None:
                self._seen[node] = (count, now, None)
            elif count is not None and last[0] != count:
                self._seen[node] = (count, now, self._read_at[node])
            self._read_at[node] = now

    def silent(self, now: float) -> Dict[str, float]:
        return {node: now - since for node, (_count, since, _after) in self._seen.items()}

    def heard_since(self, when: float) -> FrozenSet[str]:
        """The nodes known to have beaten after ``when``: their counter moved between two readings
        of this agent, the first of them at or after ``when``. (A move seen in the first reading
        after ``when`` may be a beat from before it: a node killed a moment before is not heard.)"""
        return frozenset(node for node, (_count, _since, after) in self._seen.items()
                         if after is not None and after >= when)

    def restart_silences(self, now: float) -> None:
        """Count every node's silence from ``now``: the store was away until then, and a node
        cannot beat into a store that does not answer."""
        self._seen = {node: (count, now, after) for node, (count, _since, after) in self._seen.items()}

    def forget(self, keep: Iterable[str]) -> None:
        keep = set(keep)
        self._seen = {n: v for n, v in self._seen.items() if n in keep}
        self._read_at = {n: v for n, v in self._read_at.items() if n in keep}


class Bookkeeping:
    """The facts ``decide`` needs from one agent (module docstring)."""

    def __init__(self, plan: ElasticPlan):
        self.plan = plan
        self.limits = R.Limits(plan.min_nodes, plan.max_nodes, plan.max_restarts)
        self.liveness = Liveness()
        self._seen_round = -1
        self._opened_at = 0.0
        self._min_at: Optional[float] = None
        self._waiting_since: Optional[float] = None
        self._beats_at: Optional[float] = None

    def observe(self, state: R.JobState, node: str, now: float) -> None:
        """What a read of the state tells: a new round, MIN reached, this node waiting."""
        if state.round != self._seen_round:
            self._seen_round, self._opened_at, self._min_at = state.round, now, None
        if state.phase == R.JOINING and len(state.joined) >= state.min_nodes:
            self._min_at = now if self._min_at is None else self._min_at
        else:
            self._min_at = None
        if node in state.waiting:
            self._waiting_since = self._waiting_since if self._waiting_since is not None else now
        else:
            self._waiting_since = None

    def store_was_away(self, seconds: float, now: float) -> None:
        """The store did not answer for ``seconds`` until about ``now``: that time counts for none
        of this agent's clocks. The round's windows (last call, join timeout, waiting) move on by
        it; every node's silence counts from now (nobody is lost for the store's absence)."""
        self._opened_at = min(now, self._opened_at + seconds)
        if self._min_at is not None:
            self._min_at = min(now, self._min_at + seconds)
        if self._waiting_since is not None:
            self._waiting_since = min(now, self._waiting_since + seconds)
        self.liveness.restart_silences(now)
        self._beats_at = None  # read them again at once

    def beats_due(self, now: float) -> bool:
        """Whether to read the heartbeats again: twice per keep-alive interval."""
        return self._beats_at is None or now - self._beats_at >= self.plan.conf.keep_alive_interval / 2

    def observe_beats(self, counters: Dict[str, Optional[int]], watched: Iterable[str], now: float) -> None:
        self.liveness.observe(counters, now)
        self.liveness.forget(watched)
        self._beats_at = now

    def view(self, now: float, running_round: Optional[int], failure: Optional[R.WorkerExit] = None,
             finished: bool = False, leaving: Optional[R.Leaving] = None) -> R.View:
        conf = self.plan.conf
        return R.View(now=now, silent=self.liveness.silent(now), heartbeat_bound=conf.heartbeat_bound,
                      join_timeout=conf.join_timeout, last_call_timeout=conf.last_call_timeout,
                      round_opened_at=self._opened_at, min_reached_at=self._min_at,
                      heard=self.liveness.heard_since(self._opened_at),
                      waiting_since=self._waiting_since, running_round=running_round, limits=self.limits,
                      failure=failure, finished=finished, leaving=leaving)
