"""The elastic job's state (rounds.py) kept in a store, and the nodes' heartbeats: every store
call an agent makes goes through ``RoundStore``.

Any ``Store`` with compare_set does: a TCPStore client of the master service, or a FileStore on
a shared file system (``--rdzv-endpoint file:///path``, for clusters without a master service).
The keys (distlib/keyspace.py) live under ``distlib/elastic/<run id>/``:

* ``state``: the JSON of ``JobState`` (state_record.py, its schema). Every change is a read, a
  pure decision, and a ``compare_set(state, what_was_read, new)``; when another node wrote
  first, the change is computed again from what it wrote. No lock is held, nothing is lost, and
  every node sees the same sequence of states. Every read is checked against the schema: what
  does not fit comes back as ``BadRecord`` (the key, what is wrong), never as an exception.
* ``hb/<node>``: a node's heartbeat counter, which only that node writes (``set``, the next
  number, every keep-alive interval). Others read it without waiting and without changing it
  (``peek``) and note *on their own clock* when it last moved (bookkeeping.Liveness): no two
  hosts' clocks are compared, which a timestamp in the store would do. A value that is no
  counter (a foreign write) is not a beat: it is logged once, naming the key, and the owner's
  next beat replaces it; nothing else is affected (a counter kept with ``add`` would make the
  server refuse, and drop, the connection every node's reads go through).

A store that stops answering is retried for at most ``patience`` seconds (the agent's
``--store-outage-timeout``, 60 s by default), counted from the first call of either of the
agent's clients that failed (outages.py keeps that account and says when the store goes and
comes back): a master service that restarts with its journal is back within it, and the job
goes on where it was. Past it, ``StoreGone`` names the store and how long it was tried: a job
whose store is gone cannot be restarted.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Dict, Iterable, Optional, Tuple, TypeVar, Union

from ..deadline import format_duration
from ..errors import DistError
from ..keyspace import KeySpace
from ..printable import printable
from ..store.base import Store
from ..store.chain import close_quietly
from .outages import StoreOutages
from .rounds import BadRecord, JobState
from .state_record import RecordError, decode, encode

log = logging.getLogger("distlib.launcher")

T = TypeVar("T")
#: Pause between two tries of a store that did not answer.
RETRY_PAUSE_S = 0.5
#: What ``peek`` compares with and writes back: a value no agent writes (module docstring).
_ABSENT = b"\x00distlib: no such key\x00"
#: The longest heartbeat counter (2**63 has 19 digits).
_COUNTER_DIGITS = 19

Record = Union[JobState, BadRecord, None]


class StoreGone(RuntimeError):
    """The rendezvous store stopped answering (the message names it and says for how long)."""


def peek(store: Store, key: str) -> Optional[bytes]:
    """The value at ``key`` (None when there is none), without waiting and without changing it:
    ``compare_set`` with an expected value nobody writes returns what is there, or, for a key
    that is absent, that expected value (torch's rule), and writes nothing."""
    got = store.compare_set(key, _ABSENT, _ABSENT)
    return None if got == _ABSENT else got


def parse_counter(raw: bytes) -> Optional[int]:
    """A heartbeat counter (decimal digits), or None for anything else."""
    if not raw or len(raw) > _COUNTER_DIGITS or not raw.isdigit():
        return None
    return int(raw)


class RoundStore:
    """One agent's access to the job's state and heartbeats (module docstring).

    ``connect(seconds)`` makes a new client of the store, waiting at most ``seconds`` for it:
    the first at once (``first_wait``), another after a failure, within what is left of the
    patience (a TCPStore client whose connection broke stays broken).
    """

    def __init__(self, connect: Callable[[float], Store], run_id: str, patience: float, first_wait: float,
                 outages: Optional[StoreOutages] = None, interrupted: Callable[[], bool] = lambda: False):
        self._connect = connect
        #: whether to stop retrying a store that does not answer (the agent got a signal)
        self._interrupted = interrupted
        self.keys = KeySpace(run_id)
        self.patience = patience
        self._store: Optional[Store] = connect(first_wait)
        self.where = self._store.describe()
        #: the store's absences, shared with the agent's other client (outages.py)
        self.outages = outages or StoreOutages(self.where, patience, patience,
                                               lambda text: log.warning("%s", text))
        #: node -> the value of its heartbeat key last reported as no counter (reported once)
        self._bad_beats: Dict[str, bytes] = {}

    # -- store calls, retried -------------------------------------------------------------------------

    def _call(self, what: str, fn: Callable[[Store], T]) -> T:
        while True:
            started = time.monotonic()
            try:
                if self._store is None:
                    self._store = self._connect(max(0.1, self.patience - self.outages.away()))
                result = fn(self._store)
            except (DistError, OSError) as exc:
                self._drop_client()
                away = self.outages.failed(started, what, exc)
                if away >= self.patience:
                    raise StoreGone(f"the rendezvous store ({self.where}) did not answer for {format_duration(away)} "
                                    f"({what}; --store-outage-timeout {format_duration(self.patience)}): "
                                    f"{exc}") from exc
                if self._interrupted():
                    raise StoreGone(f"the rendezvous store ({self.where}) did not answer ({what}: {exc}); stopped "
                                    f"waiting for it after {format_duration(away)}: this node received a signal") \
                        from exc
                time.sleep(min(RETRY_PAUSE_S, self.patience - away))
                continue
            self.outages.answered(started, what)
            return result

    def _drop_client(self) -> None:
        store, self._store = self._store, None
        close_quietly(store)

    def close(self) -> None:
        self._drop_client()

    def local_address(self) -> Optional[str]:
        """The local address of this agent's connection to a TCP store (the route that works)."""
        address = getattr(self._store, "local_address", None)
        return address() if address is not None else None

    # -- the state ----------------------------------------------------------------------------------------

    def read(self) -> Tuple[bytes, Record]:
        """(raw bytes, what they hold): (b"", None) before any node wrote a state; a
        ``BadRecord`` naming the key and the problem when they are not a valid state."""
        key = self.keys.elastic_state()
        raw = self._call("reading the job's state", lambda store: peek(store, key))
        if raw is None:
            return b"", None
        try:
            return raw, decode(raw)
        except RecordError as exc:
            return raw, BadRecord(key, str(exc))

    def write(self, raw: bytes, new: JobState) -> bool:
        """compare_set from ``raw`` (b"": no state yet) to ``new``; False when another node wrote first."""
        desired = encode(new)
        key = self.keys.elastic_state()
        got = self._call("writing the job's state", lambda store: store.compare_set(key, raw, desired))
        return got == desired

    # -- heartbeats -------------------------------------------------------------------------------------

    def beat(self, node: str, count: int) -> None:
        """Set ``node``'s heartbeat counter to ``count`` (only that node's agent calls this)."""
        self._call("a heartbeat", lambda store: store.set(self.keys.heartbeat(node), str(count).encode()))

    def beats(self, nodes: Iterable[str]) -> Dict[str, Optional[int]]:
        """Each node's heartbeat counter: 0 when it never beat, None when its key holds
        something that is no counter (logged once per key and value), without blocking."""
        nodes = list(nodes)
        raw = self._call("reading heartbeats", lambda store: {n: peek(store, self.keys.heartbeat(n)) for n in nodes})
        out: Dict[str, Optional[int]] = {}
        for node, value in raw.items():
            if value is None:
                out[node] = 0
                continue
            out[node] = parse_counter(value)
            if out[node] is not None:
                self._bad_beats.pop(node, None)
            elif self._bad_beats.get(node) != value:
                self._bad_beats[node] = value
                shown = printable(value[:60].decode("utf-8", "replace"))
                log.warning("the heartbeat key %s holds %r, which is no counter (something else wrote it): not "
                            "counted as a beat; the node's next beat replaces it", self.keys.heartbeat(node), shown)
        return out


class Heartbeat:
    """A thread that sets this node's counter to the next number every ``interval`` seconds, on
    its own client of the store; ``problem`` holds why it could not, once it has failed for
    longer than the store's patience."""

    def __init__(self, rounds: RoundStore, node: str, interval: float):
        self._rounds = rounds
        self.node = node
        self._interval = interval
        self._count = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.problem: Optional[str] = None
        self._thread = threading.Thread(target=self._run, name="distlib-run-heartbeat", daemon=True)

    def start(self) -> "Heartbeat":
        self._beat()  # the first one before anyone looks
        self._thread.start()
        return self

    def retarget(self, node: str) -> None:
        """Beat for ``node`` from now on, the first time at once (before it joins as that node)."""
        with self._lock:
            self.node = node
        self._beat()

    def _beat(self) -> None:
        with self._lock:
            self._count += 1
            self._rounds.beat(self.node, self._count)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self._beat()
            except StoreGone as exc:
                self.problem = str(exc)
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(self._interval + 1.0)
        self._rounds.close()
