"""Joining a group: every rank claims its rank in the store and waits for everyone's claim.

This is where init_process_group blocks until every rank has arrived. A rank's claim is its
join record written with compare_set on ``join/<rank>``: the store takes the first claim and
hands later claimants the record that won, so two processes started with the same RANK can no
longer overwrite each other (the second fails at once, naming both; the first goes on, and the
group's timeout error names the duplicate too: it is recorded under ``join/duplicate/<n>``).

While it waits it polls which ranks have arrived (only those still missing, every
``poll_interval``) and logs, every few seconds, how many of how many have joined; when the
timeout passes it raises an error that names the ranks that never arrived and where each was
expected: the node it belongs to (``rank // LOCAL_WORLD_SIZE`` when the launcher set it) and
the host that node's other ranks reported, or that no rank of that node arrived at all. The
last poll is kept so that a rank that loses the store (rank 0 hosted it and gave up first)
still says which ranks were missing.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import time
from typing import Any, Dict, List, Optional

from ..deadline import Deadline, format_duration
from ..errors import DistNetworkError, DistStoreError
from ..identity import Identity
from ..store import StoreStateLost

log = logging.getLogger("distlib.join")

PROGRESS_INTERVAL = 5.0  # seconds between "k/n joined" log lines
#: Shortest time between two polls of who has arrived: a rank must have seen the missing ranks
#: before rank 0 (hosting the store) gives up, and each poll costs one CHECK per missing rank.
MIN_POLL_S = 0.2

#: Tells this process's own earlier claims (an init, destroy and init again on one store) from
#: another process's: a claim with this tag and this pid is stale, not a duplicate.
_PROCESS_TAG = secrets.token_hex(8)

_DUPLICATES = "join/duplicates"


def local_facts(identity: Identity = Identity()) -> Dict[str, Any]:
    """What a rank says about itself (helps name the missing ones and a duplicate claimant):
    its host and process, and its node and the ranks per node where its identity says them
    (given by the backend's creator: a backend reads no launcher variable)."""
    facts: Dict[str, Any] = {"hostname": socket.gethostname(), "pid": os.getpid(), "process": _PROCESS_TAG}
    if identity.node_rank is not None:
        facts["node"] = identity.node_rank
    if identity.local_world_size is not None:
        facts["local_world_size"] = identity.local_world_size
    return facts


def _key(rank: int) -> str:
    return f"join/{rank}"


def _duplicate_key(number: int) -> str:
    return f"join/duplicate/{number}"


def claimant(record: Dict[str, Any]) -> str:
    """``host <name> pid <n>``: who a join record says it is."""
    return f"host {record.get('hostname', '?')} pid {record.get('pid', '?')}"


class Arrivals:
    """What this rank last saw in the store: which ranks were missing, which ranks were claimed
    twice. Polls ask only about ranks still missing (a join key is never deleted)."""

    def __init__(self, size: int):
        self.size = size
        self.missing: List[int] = list(range(size))
        self.duplicates: List[str] = []
        self.seen_at: Optional[float] = None  # monotonic time of the last complete poll

    def poll(self, store) -> None:
        self.missing = [r for r in self.missing if not store.check([_key(r)])]
        self.duplicates = read_duplicates(store)
        self.seen_at = time.monotonic()


def read_duplicates(store) -> List[str]:
    """The duplicate claims recorded in the group's store, as sentences."""
    if not store.check([_DUPLICATES]):
        return []
    found = []
    for number in range(1, store.add(_DUPLICATES, 0) + 1):
        try:
            found.append(json.loads(store.get(_duplicate_key(number)))["text"])
        except (DistStoreError, ValueError, KeyError, TypeError):
            continue  # the claimant is still writing it
    return found


def publish_and_gather(store, rank: int, size: int, record: Dict[str, Any], deadline: Deadline,
                       label: str) -> List[Dict[str, Any]]:
    """Claim ``rank`` with ``record``; return every rank's record, in rank order.

    ValueError at once when another process holds the rank. A store that goes away at any
    point of this (while waiting, while reading who joined for the timeout error, while
    fetching the records) is reported as a lost store, with the ranks this rank last saw
    missing: when rank 0 hosts it and gives up first, the other ranks' wait and their timeout
    error race its exit, and either way the useful answer is which ranks never came.
    """
    arrivals = Arrivals(size)
    try:
        claim(store, rank, record, label)
        keys = [_key(r) for r in range(size)]
        _wait_for_everyone(store, size, keys, deadline, label, arrivals)
        return [json.loads(v) for v in store.multi_get(keys)]
    except DistNetworkError as exc:
        raise DistStoreError(_lost_store_text(store, deadline, label, arrivals, exc)) from None


def claim(store, rank: int, record: Dict[str, Any], label: str) -> None:
    """Write this rank's join record unless another process has claimed the rank (ValueError
    naming both, after recording the duplicate for the group's timeout error)."""
    mine = json.dumps(record)
    held = store.compare_set(_key(rank), "", mine)
    if held == mine.encode():
        return
    try:
        holder = json.loads(held)
    except ValueError:
        holder = {}
    if holder.get("process") == record.get("process") and holder.get("pid") == record.get("pid"):
        store.set(_key(rank), mine)  # this process's own claim from an earlier init on this store
        return
    text = (f"rank {rank} was claimed twice: first by {claimant(holder)}, then by {claimant(record)}; "
            f"two processes were started with the same RANK")
    number = store.add(_DUPLICATES, 1)
    store.set(_duplicate_key(number), json.dumps({"rank": rank, "text": text}))
    raise ValueError(f"{label}: {text}. This process ({claimant(record)}) gives up; the one that claimed "
                     f"rank {rank} first goes on. Check the launcher's RANK (or rank=) for every process; if "
                     f"the first claimant is no longer running, the store holds an earlier job's keys (a reused "
                     f"store file, or a master service with the same run id): start with a fresh one or a new "
                     f"DISTLIB_RUN_ID.")


def _poll_interval(deadline: Deadline) -> float:
    return min(PROGRESS_INTERVAL, max(MIN_POLL_S, deadline.seconds / 10))


def _wait_for_everyone(store, size: int, keys: List[str], deadline: Deadline, label: str,
                       arrivals: Arrivals) -> None:
    """Wait until every rank's key exists, polling who is missing (see Arrivals) and logging it
    every PROGRESS_INTERVAL."""
    interval = _poll_interval(deadline)
    next_poll = interval
    next_log = PROGRESS_INTERVAL
    while True:
        left = deadline.remaining()
        try:
            store.wait(keys, max(0.001, min(left, next_poll - deadline.elapsed())))
            return
        except DistNetworkError:
            raise
        except StoreStateLost as exc:  # the master came back empty: the keys are not coming
            raise StoreStateLost(f"{label}: {exc}") from None
        except DistStoreError:
            if deadline.expired():
                raise _timeout_error(store, size, deadline, label, arrivals) from None
            if deadline.elapsed() < next_poll:
                continue
            arrivals.poll(store)
            next_poll = deadline.elapsed() + interval
            if deadline.elapsed() >= next_log:
                log.warning("%s: %d/%d ranks joined after %s; waiting for ranks %s (timeout %s)%s",
                            label, size - len(arrivals.missing), size, format_duration(deadline.elapsed()),
                            _ranks_text(arrivals.missing), format_duration(deadline.seconds),
                            _duplicates_text(arrivals.duplicates))
                next_log = deadline.elapsed() + PROGRESS_INTERVAL


def _ranks_text(ranks: List[int], limit: int = 16) -> str:
    shown = ", ".join(str(r) for r in ranks[:limit])
    return shown + (f" (+{len(ranks) - limit} more)" if len(ranks) > limit else "")


def _duplicates_text(duplicates: List[str]) -> str:
    return f". Duplicate claims: {'; '.join(duplicates)}" if duplicates else ""


def _lost_store_text(store, deadline: Deadline, label: str, arrivals: Arrivals, exc: Exception) -> str:
    if arrivals.seen_at is not None and arrivals.missing:
        seen = (f"while waiting for ranks {_ranks_text(arrivals.missing)} (the last look, "
                f"{format_duration(time.monotonic() - arrivals.seen_at)} before)")
    elif arrivals.seen_at is not None:
        seen = "after every rank had arrived"
    else:
        seen = "before this rank could see which ranks had arrived"
    return (f"{label}: lost the store at {store.describe()} (rank 0 gave up?) "
            f"{format_duration(deadline.elapsed())} into waiting for every rank to join, {seen}"
            f"{_duplicates_text(arrivals.duplicates)}. If a master service runs it (distlib store-server), "
            f"the service stopped; if rank 0 hosts it, rank 0 gave up after its timeout or died, and its "
            f"error names the ranks that never arrived. Store error: {exc}")


def _timeout_error(store, size: int, deadline: Deadline, label: str, arrivals: Arrivals) -> DistStoreError:
    records: Dict[int, Dict[str, Any]] = {}
    for r in range(size):
        if store.check([_key(r)]):
            try:
                records[r] = json.loads(store.get(_key(r)))
            except (DistStoreError, ValueError):
                records[r] = {}
    missing = [r for r in range(size) if r not in records]
    duplicates = read_duplicates(store)
    return DistStoreError(
        f"{label}: timed out after {format_duration(deadline.seconds)} waiting for every rank to join: "
        f"{len(records)}/{size} joined; never arrived: {describe_missing(missing, records)}. "
        f"Joined: {describe_joined(records)}{_duplicates_text(duplicates)}. Check that the missing ranks were "
        f"started with the same MASTER_ADDR/MASTER_PORT (or init_method) and WORLD_SIZE={size}, and read their "
        f"logs.")


def describe_missing(missing: List[int], records: Dict[int, Dict[str, Any]]) -> str:
    sizes = {rec.get("local_world_size") for rec in records.values() if rec.get("local_world_size")}
    per_node: Optional[int] = sizes.pop() if len(sizes) == 1 else None
    hosts_of_node: Dict[int, set] = {}
    for rec in records.values():
        if "node" in rec:
            hosts_of_node.setdefault(int(rec["node"]), set()).add(str(rec.get("hostname", "?")))
    parts = []
    for r in missing[:16]:
        if per_node:
            node = r // per_node
            hosts = hosts_of_node.get(node)
            where = (f"expected on node {node} (host {', '.join(sorted(hosts))})" if hosts
                     else f"expected on node {node}, from which no rank arrived")
        else:
            where = "expected host unknown (set LOCAL_WORLD_SIZE/GROUP_RANK, as distlib-run does, to know)"
        parts.append(f"rank {r} {where}")
    if len(missing) > 16:
        parts.append(f"and {len(missing) - 16} more")
    return "; ".join(parts)


def describe_joined(records: Dict[int, Dict[str, Any]], limit: int = 8) -> str:
    items = []
    for r in sorted(records)[:limit]:
        rec = records[r]
        addr = rec.get("addresses", [[None]])[0][0] if rec.get("addresses") else None
        items.append(f"rank {r} on {rec.get('hostname', '?')}" + (f" ({addr})" if addr else ""))
    if len(records) > limit:
        items.append(f"... {len(records) - limit} more")
    return ", ".join(items) or "none"
