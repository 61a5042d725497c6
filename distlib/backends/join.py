"""Joining a group: every rank publishes a record in the store and waits for everyone's.

This is where init_process_group blocks until every rank has arrived. While it waits it logs,
every few seconds, how many of how many have joined and which ranks are missing; when the
timeout passes it raises an error that names the ranks that never arrived and where each was
expected: the node it belongs to (``rank // LOCAL_WORLD_SIZE`` when the launcher set it) and
the host that node's other ranks reported, or that no rank of that node arrived at all.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from typing import Dict, List, Optional

from ..deadline import Deadline, format_duration
from ..errors import DistNetworkError, DistStoreError

log = logging.getLogger("distlib.join")

PROGRESS_INTERVAL = 5.0  # seconds between "k/n joined" log lines


def local_facts() -> Dict[str, object]:
    """What a rank says about itself (helps name the missing ones)."""
    facts: Dict[str, object] = {"hostname": socket.gethostname(), "pid": os.getpid()}
    for key, env in (("node", "GROUP_RANK"), ("local_world_size", "LOCAL_WORLD_SIZE")):
        value = os.environ.get(env, "")
        if value.isdigit():
            facts[key] = int(value)
    return facts


def _key(rank: int) -> str:
    return f"join/{rank}"


def publish_and_gather(store, rank: int, size: int, record: Dict[str, object], deadline: Deadline,
                       label: str) -> List[Dict[str, object]]:
    """Publish ``record`` for ``rank``; return every rank's record, in rank order.

    A store that goes away at any point of this (while waiting, while reading who joined
    for the timeout error, while fetching the records) is reported as a lost store: when
    rank 0 hosts it and gives up first, the other ranks' wait and their timeout error race
    its exit, and either way the useful answer is rank 0's error.
    """
    try:
        store.set(_key(rank), json.dumps(record))
        keys = [_key(r) for r in range(size)]
        _wait_for_everyone(store, rank, size, keys, deadline, label)
        return [json.loads(v) for v in store.multi_get(keys)]
    except DistNetworkError as exc:
        raise DistStoreError(
            f"{label}: lost the store ({store.describe()}) {format_duration(deadline.elapsed())} into waiting "
            f"for every rank to join. If a master service runs it (distlib store-server), the service "
            f"stopped; if rank 0 hosts it, rank 0 gave up after its timeout or died, and its error names "
            f"the ranks that never arrived. Store error: {exc}") from None


def _wait_for_everyone(store, rank: int, size: int, keys: List[str], deadline: Deadline, label: str) -> None:
    """Wait until every rank's key exists, logging who is missing every PROGRESS_INTERVAL."""
    next_log = PROGRESS_INTERVAL
    while True:
        left = deadline.remaining()
        try:
            store.wait(keys, max(0.001, min(left, next_log - deadline.elapsed())))
            return
        except DistNetworkError:
            raise
        except DistStoreError:
            if deadline.expired():
                raise _timeout_error(store, rank, size, deadline, label) from None
            if deadline.elapsed() >= next_log:
                present = [r for r in range(size) if store.check([_key(r)])]
                missing = sorted(set(range(size)) - set(present))
                log.warning("%s: %d/%d ranks joined after %s; waiting for ranks %s (timeout %s)",
                            label, len(present), size, format_duration(deadline.elapsed()),
                            _ranks_text(missing), format_duration(deadline.seconds))
                next_log = deadline.elapsed() + PROGRESS_INTERVAL


def _ranks_text(ranks: List[int], limit: int = 16) -> str:
    shown = ", ".join(str(r) for r in ranks[:limit])
    return shown + (f" (+{len(ranks) - limit} more)" if len(ranks) > limit else "")


def _timeout_error(store, rank: int, size: int, deadline: Deadline, label: str) -> DistStoreError:
    records: Dict[int, Dict[str, object]] = {}
    for r in range(size):
        if store.check([_key(r)]):
            try:
                records[r] = json.loads(store.get(_key(r)))
            except (DistStoreError, ValueError):
                records[r] = {}
    missing = [r for r in range(size) if r not in records]
    return DistStoreError(
        f"{label}: timed out after {format_duration(deadline.seconds)} waiting for every rank to join: "
        f"{len(records)}/{size} joined; never arrived: {describe_missing(missing, records)}. "
        f"Joined: {describe_joined(records)}. Check that the missing ranks were started with the same "
        f"MASTER_ADDR/MASTER_PORT (or init_method) and WORLD_SIZE={size}, and read their logs.")


def describe_missing(missing: List[int], records: Dict[int, Dict[str, object]]) -> str:
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


def describe_joined(records: Dict[int, Dict[str, object]], limit: int = 8) -> str:
    items = []
    for r in sorted(records)[:limit]:
        rec = records[r]
        addr = rec.get("addresses", [[None]])[0][0] if rec.get("addresses") else None
        items.append(f"rank {r} on {rec.get('hostname', '?')}" + (f" ({addr})" if addr else ""))
    if len(records) > limit:
        items.append(f"... {len(records) - limit} more")
    return ", ".join(items) or "none"
