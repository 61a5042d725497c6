"""The elastic job's state (rounds.py) kept in a store, and the nodes' heartbeats.

Any ``Store`` with compare_set does: a TCPStore client of the master service, or a FileStore on
a shared file system (``--rdzv-endpoint file:///path``, for clusters without a master service).
Keys live under ``distlib/elastic/<run id>/``:

* ``state``: the JSON of ``JobState``. Every change is a read, a pure transition, and a
  ``compare_set(state, what_was_read, new)``; when another node wrote first, the change is
  computed again from what it wrote. No lock is held, nothing is lost, and every node sees the
  same sequence of states.
* ``hb/<node>``: a counter each agent increments every keep-alive interval (``add``). Others read
  it with ``add(key, 0)`` (which never blocks) and note *on their own clock* when it last moved
  (``Liveness``): no two hosts' clocks are compared, which a timestamp in the store would do.

A store that stops answering is retried (saying so) for at most ``patience`` seconds, by
default the heartbeat bound: the store is a member of the job too, and a job whose store is
gone cannot be restarted; then ``StoreGone`` names the store and how long it was tried.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Dict, Iterable, Optional, Tuple, TypeVar

from ..deadline import format_duration
from ..errors import DistError
from ..store.base import Store
from .rounds import JobState

log = logging.getLogger("distlib.launcher")

T = TypeVar("T")
#: Pause between two tries of a store that did not answer.
RETRY_PAUSE_S = 0.5


class StoreGone(RuntimeError):
    """The rendezvous store stopped answering (the message names it and says for how long)."""


def key_prefix(run_id: str) -> str:
    return f"distlib/elastic/{run_id}/"


class RoundStore:
    """One agent's access to the job's state and heartbeats (module docstring).

    ``connect(seconds)`` makes a new client of the store, waiting at most ``seconds`` for it:
    the first at once (``first_wait``), another after a failure, within what is left of the
    patience (a TCPStore client whose connection broke stays broken).
    """

    def __init__(self, connect: Callable[[float], Store], run_id: str, patience: float, first_wait: float):
        self._connect = connect
        self._prefix = key_prefix(run_id)
        self.patience = patience
        self._store: Optional[Store] = connect(first_wait)
        self.where = self._store.describe()

    # -- store calls, retried -------------------------------------------------------------------------

    def _call(self, what: str, fn: Callable[[Store], T]) -> T:
        started = time.monotonic()
        said = False
        while True:
            try:
                if self._store is None:
                    self._store = self._connect(max(0.1, self.patience - (time.monotonic() - started)))
                return fn(self._store)
            except (DistError, OSError) as exc:
                self._drop_client()
                waited = time.monotonic() - started
                if waited >= self.patience:
                    raise StoreGone(f"the rendezvous store ({self.where}) did not answer for "
                                    f"{format_duration(waited)} ({what}): {exc}") from exc
                if not said:
                    log.warning("the rendezvous store (%s) did not answer (%s: %s): retrying for up to %s",
                                self.where, what, exc, format_duration(self.patience))
                    said = True
                time.sleep(min(RETRY_PAUSE_S, max(0.0, self.patience - waited)))

    def _drop_client(self) -> None:
        store, self._store = self._store, None
        close = getattr(store, "close", None)
        if close is not None:
            try:
                close()
            except (DistError, OSError):
                pass

    def close(self) -> None:
        self._drop_client()

    def local_address(self) -> Optional[str]:
        """The local address of this agent's connection to a TCP store (the route that works)."""
        address = getattr(self._store, "local_address", None)
        return address() if address is not None else None

    # -- the state ----------------------------------------------------------------------------------------

    def read(self) -> Tuple[bytes, Optional[JobState]]:
        """(raw bytes, state), or (b"", None) before any node wrote one. ValueError when the key
        holds something that is not a state (another program's key)."""
        key = self._prefix + "state"

        def get(store: Store) -> bytes:
            return store.get(key) if store.check([key]) else b""

        raw = self._call("reading the job's state", get)
        return raw, (JobState.from_json(raw) if raw else None)

    def write(self, raw: bytes, new: JobState) -> bool:
        """compare_set from ``raw`` (b"": no state yet) to ``new``; False when another node wrote first."""
        desired = new.to_json()
        key = self._prefix + "state"
        got = self._call("writing the job's state", lambda store: store.compare_set(key, raw, desired))
        return got == desired

    def update(self, change: Callable[[Optional[JobState]], Optional[JobState]]) -> Optional[JobState]:
        """Apply ``change`` to the current state until it sticks; the state after it."""
        while True:
            raw, state = self.read()
            new = change(state)
            if new is None or new == state:
                return state
            if self.write(raw, new):
                return new

    # -- heartbeats -------------------------------------------------------------------------------------

    def beat(self, node: str) -> int:
        return self._call("a heartbeat", lambda store: store.add(self._prefix + "hb/" + node, 1))

    def beats(self, nodes: Iterable[str]) -> Dict[str, int]:
        """Each node's heartbeat counter (0: never beat), without blocking."""
        nodes = list(nodes)
        return self._call("reading heartbeats",
                          lambda store: {n: store.add(self._prefix + "hb/" + n, 0) for n in nodes})


class Liveness:
    """When this agent last saw each node's heartbeat counter move, on its own monotonic clock."""

    def __init__(self):
        self._seen: Dict[str, Tuple[int, float]] = {}

    def observe(self, counters: Dict[str, int], now: float) -> None:
        for node, count in counters.items():
            last = self._seen.get(node)
            if last is None or last[0] != count:
                self._seen[node] = (count, now)

    def silent(self, now: float) -> Dict[str, float]:
        return {node: now - since for node, (_count, since) in self._seen.items()}

    def forget(self, keep: Iterable[str]) -> None:
        keep = set(keep)
        self._seen = {n: v for n, v in self._seen.items() if n in keep}


class Heartbeat:
    """A thread that increments this node's counter every ``interval`` seconds, on its own
    client of the store; ``problem`` holds why it could not, once it has failed for longer than
    the store's patience."""

    def __init__(self, rounds: RoundStore, node: str, interval: float):
        self._rounds = rounds
        self.node = node
        self._interval = interval
        self._stop = threading.Event()
        self.problem: Optional[str] = None
        self._thread = threading.Thread(target=self._run, name="distlib-run-heartbeat", daemon=True)

    def start(self) -> "Heartbeat":
        self._rounds.beat(self.node)  # the first one before anyone looks
        self._thread.start()
        return self

    def retarget(self, node: str) -> None:
        self.node = node

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self._rounds.beat(self.node)
            except StoreGone as exc:
                self.problem = str(exc)
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(self._interval + 1.0)
        self._rounds.close()
