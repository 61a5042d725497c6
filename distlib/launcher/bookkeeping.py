"""One elastic agent's observations between two reads of the job's state, on its own clock, and
the ``rounds.View`` they make.

``rounds.decide`` is pure: it needs to be told how long this agent has seen the current round
open, since when at least MIN nodes have joined, since when this node waits to be admitted,
how long each node's heartbeat has not moved, and what happened to this node's workers and to
the agent itself (a signal). ``Bookkeeping`` keeps those facts, updates them from each state
read and each heartbeat reading, and hands ``decide`` the view. It reads no store and starts no
process: the agent (elastic_agent.py) feeds it.
"""

from __future__ import annotations

from typing import Dict, Iterable, Optional, Tuple

from . import rounds as R
from .elastic_config import ElasticPlan


class Liveness:
    """When this agent last saw each node's heartbeat counter move, on its own monotonic clock.
    A counter that cannot be read (None: its key holds no counter) is not a move: the node's
    silence goes on counting from when it was first watched."""

    def __init__(self) -> None:
        self._seen: Dict[str, Tuple[Optional[int], float]] = {}

    def observe(self, counters: Dict[str, Optional[int]], now: float) -> None:
        for node, count in counters.items():
            last = self._seen.get(node)
            if last is None or (count is not None and last[0] != count):
                self._seen[node] = (count, now)

    def silent(self, now: float) -> Dict[str, float]:
        return {node: now - since for node, (_count, since) in self._seen.items()}

    def forget(self, keep: Iterable[str]) -> None:
        keep = set(keep)
        self._seen = {n: v for n, v in self._seen.items() if n in keep}


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
                      waiting_since=self._waiting_since, running_round=running_round, limits=self.limits,
                      failure=failure, finished=finished, leaving=leaving)
