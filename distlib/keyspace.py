"""Where a job keeps its keys: one name for each, from (run id, attempt).

Many jobs may share one master service (``distlib store-server``), and an elastic job restarts
its workers in rounds whose keys must never meet the round before's. Every name that depends
on the run or the attempt is made here, so that the rendezvous (the workers' store),
the launcher (``--node-rank auto``, the elastic agents' state and heartbeats, a round's file
store) and ``--dry-run``'s report agree by construction:

==============================  ===================================================
``store_prefix()``              ``distlib/run/<run id>`` (attempt 0) or
                                ``distlib/run/<run id>/attempt_<N>`` (a restarted
                                round): the workers' keys on a shared master service
``node_rank_counter()``         ``distlib/run/<run id>/node_rank``: ``--node-rank auto``
``elastic_state()``             ``distlib/elastic/<run id>/state``: the elastic job's state
``heartbeat(node)``             ``distlib/elastic/<run id>/hb/<node>``: a node's heartbeat
``file_store(path)``            ``<path>.<run id>.attempt_<N>``: a round's FileStore
                                (an elastic job with a ``file://`` endpoint)
``attempt_name()``              ``attempt_<N>``: also the workers' log directory
==============================  ===================================================

The attempt is ``TORCHELASTIC_RESTART_COUNT``, the elastic round's number (0 for a job that
never restarted), the same on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

RUNS = "distlib/run"
ELASTIC = "distlib/elastic"


@dataclass(frozen=True)
class KeySpace:
    """The keys of run ``run_id`` (may be "": a job without a run id) in attempt ``attempt``."""

    run_id: str
    attempt: int = 0

    def attempt_name(self) -> str:
        return f"attempt_{self.attempt}"

    def of_attempt(self, attempt: int) -> "KeySpace":
        return KeySpace(self.run_id, attempt)

    def store_prefix(self) -> str:
        """The prefix of the workers' keys ("" for attempt 0 of a job without a run id). Attempt
        0 has none of its own, so that a fixed-size job's keys are where they always were."""
        parts = [f"{RUNS}/{self.run_id}" if self.run_id else "", self.attempt_name() if self.attempt > 0 else ""]
        return "/".join(p for p in parts if p)

    def node_rank_counter(self) -> str:
        return f"{RUNS}/{self.run_id}/node_rank"

    def elastic_prefix(self) -> str:
        return f"{ELASTIC}/{self.run_id}/"

    def elastic_state(self) -> str:
        return self.elastic_prefix() + "state"

    def heartbeat(self, node: str) -> str:
        return self.elastic_prefix() + "hb/" + node

    def file_store(self, path: str) -> str:
        """The FileStore of this attempt, beside ``path`` (the ``file://`` endpoint)."""
        return f"{path}.{self.run_id}.{self.attempt_name()}"
