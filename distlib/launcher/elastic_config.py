"""The elastic settings of a run: torchrun's ``--max-restarts``, ``--monitor-interval`` and
``--rdzv-conf``, and whether the launch is elastic at all.

A launch is elastic (rounds on a store, restarts, membership changes: ``elastic_agent.py``)
when ``--nnodes`` is a range ``MIN:MAX`` with MIN < MAX, when ``--max-restarts`` is above 0, or
when the rendezvous endpoint is a file (``--rdzv-endpoint file:///path``). Otherwise the
fixed-size launch of ``launch.py`` runs, unchanged.

``--rdzv-conf key=value,key=value`` takes torch's keys (torch's c10d/dynamic rendezvous):

==========================  =======  =================================================================
key                         default  meaning
==========================  =======  =================================================================
``join_timeout``            600      seconds a node waits for a round to reach MIN nodes (or, late,
                                     to be admitted) before it fails naming who is missing
``last_call_timeout``       30       seconds a round stays open for more nodes once MIN have joined
                                     (a restart round closes sooner: as soon as every node of the
                                     previous round that is still alive has joined)
``close_timeout``           30       seconds an agent keeps a store it hosts up for the other nodes
                                     after the job ended
``keep_alive_interval``     2        seconds between two heartbeats of a node
``keep_alive_max_attempt``  5        heartbeats a node may miss: a node silent for interval x
                                     attempts (10 s by default; torch: 5 x 3 = 15 s) is lost
``heartbeat_timeout``       5        seconds one store call of an agent may take (a heartbeat, a
                                     read of the rounds); a slower one met a store that was away
``timeout``                 60       seconds to wait for the store (the master service) to answer
==========================  =======  =================================================================

torch's other keys (``is_host``, ``store_type``, ``use_libuv``, ``local_addr``) are accepted and
ignored with a note; an unknown key is an error (a typo would otherwise be a silent default).

``--store-outage-timeout S`` (``DISTLIB_STORE_OUTAGE_TIMEOUT``, default 60; distlib's, torch has
none): how long the agents ride out a store that stopped answering (outages.py) before the job
fails naming it. ``heartbeat_timeout`` is also how long one store call of an agent may take
before the store counts as away for that time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Dict, List, Optional, Tuple

from .resolve import Resolved, ResolveError

#: torchrun's default ``--monitor-interval`` (seconds between two looks at the workers).
DEFAULT_MONITOR_INTERVAL = 0.1
#: distlib-run's default ``--store-outage-timeout``: seconds the agents ride out a store that stopped
#: answering (a master service that restarts and replays its journal is back well within it).
DEFAULT_OUTAGE_BOUND = 60.0
#: Keys torch's rendezvous handlers take that mean nothing here.
IGNORED_KEYS = ("is_host", "store_type", "use_libuv", "local_addr")


@dataclass(frozen=True)
class RdzvConf:
    """The values of ``--rdzv-conf`` (module docstring), in seconds."""

    join_timeout: float = 600.0
    last_call_timeout: float = 30.0
    close_timeout: float = 30.0
    keep_alive_interval: float = 2.0
    keep_alive_max_attempt: int = 5
    heartbeat_timeout: float = 5.0
    timeout: float = 60.0

    @property
    def heartbeat_bound(self) -> float:
        """Seconds of silence after which a node is lost: interval x attempts (torch's rule)."""
        return self.keep_alive_interval * self.keep_alive_max_attempt


_SECONDS = ("join_timeout", "last_call_timeout", "close_timeout", "keep_alive_interval", "heartbeat_timeout",
            "timeout")


def parse_rdzv_conf(text: Optional[str], source: str = "flag --rdzv-conf") -> Tuple[RdzvConf, List[str]]:
    """``key=value,key=value`` → (RdzvConf, notes). ResolveError names the key and the value."""
    conf = RdzvConf()
    notes: List[str] = []
    if not text or not text.strip():
        return conf, notes
    values: Dict[str, Any] = {}  # RdzvConf field -> value: keep_alive_max_attempt a count, the rest seconds
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key:
            raise ResolveError(f"--rdzv-conf {text!r} (from {source}): {item!r} is not key=value")
        if key in IGNORED_KEYS:
            notes.append(f"--rdzv-conf {key}={value}: torch's key, not used by distlib-run (ignored)")
            continue
        if key == "keep_alive_max_attempt":
            try:
                values[key] = int(value)
            except ValueError:
                raise ResolveError(f"--rdzv-conf {key}={value!r} (from {source}): not a whole number") from None
            if values[key] < 1:
                raise ResolveError(f"--rdzv-conf {key}={value} (from {source}): must be at least 1")
            continue
        if key not in _SECONDS:
            known = ", ".join(_SECONDS + ("keep_alive_max_attempt",) + IGNORED_KEYS)
            raise ResolveError(f"--rdzv-conf {text!r} (from {source}): unknown key {key!r} (known: {known})")
        try:
            seconds = float(value)
        except ValueError:
            raise ResolveError(f"--rdzv-conf {key}={value!r} (from {source}): not a number of seconds") from None
        if not math.isfinite(seconds) or seconds <= 0:
            raise ResolveError(f"--rdzv-conf {key}={value} (from {source}): must be a positive number of seconds")
        values[key] = seconds
    return replace(conf, **values), notes


@dataclass(frozen=True)
class ElasticPlan:
    """Everything the elastic agent needs beyond ``Resolved``."""

    min_nodes: int
    max_nodes: int
    max_restarts: int
    monitor_interval: float
    conf: RdzvConf = field(default_factory=RdzvConf)
    notes: Tuple[str, ...] = ()
    #: seconds the job waits for a store that stopped answering (--store-outage-timeout)
    outage_bound: float = DEFAULT_OUTAGE_BOUND

    @property
    def range_text(self) -> str:
        return f"{self.min_nodes}:{self.max_nodes}" if self.min_nodes != self.max_nodes else str(self.max_nodes)


def is_elastic(resolved: Resolved, max_restarts: int) -> bool:
    """True when the launch needs rounds (module docstring)."""
    return resolved.fewest_nodes < resolved.nnodes.value or max_restarts > 0 or resolved.rdzv_file is not None


def elastic_plan(resolved: Resolved, max_restarts: int, monitor_interval: float,
                 rdzv_conf: Optional[str], outage_bound: float = DEFAULT_OUTAGE_BOUND) -> ElasticPlan:
    """Check that ``resolved`` can run elastic and return the plan (ResolveError says why not)."""
    conf, notes = parse_rdzv_conf(rdzv_conf)
    if not (math.isfinite(outage_bound) and outage_bound >= 0):
        raise ResolveError(f"--store-outage-timeout must be 0 or more seconds, got {outage_bound}")
    if max_restarts < 0:
        raise ResolveError(f"--max-restarts must be 0 or more, got {max_restarts}")
    if not monitor_interval > 0:
        raise ResolveError(f"--monitor-interval must be a positive number of seconds, got {monitor_interval}")
    low, high = resolved.fewest_nodes, resolved.nnodes.value
    if not resolved.c10d and low != high:
        raise ResolveError(
            f"--nnodes {low}:{high} with --rdzv-backend static: static means a fixed set of nodes (node 0 hosts "
            "the store); an elastic range needs --rdzv-backend c10d with a master service or a file:// endpoint")
    if resolved.init_method is not None:
        raise ResolveError(
            f"DISTLIB_INIT_METHOD={resolved.init_method.value!r} is set, but restarts and membership changes need a "
            "store for every round: use --rdzv-backend c10d --rdzv-endpoint HOST:PORT (a master service) or "
            "--rdzv-endpoint file:///PATH (a shared file) and unset DISTLIB_INIT_METHOD")
    if resolved.private_store and high > 1:
        raise ResolveError("a private store on a free port (--standalone, endpoint port 0) serves one node only: "
                           "an elastic range needs a master service every node reaches")
    return ElasticPlan(min_nodes=low, max_nodes=high, max_restarts=max_restarts,
                       monitor_interval=monitor_interval, conf=conf, notes=tuple(notes), outage_bound=outage_bound)
