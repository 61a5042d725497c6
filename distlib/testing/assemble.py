"""A run's events, put together into its Result: a record per host and per rank."""

from __future__ import annotations

import os
import pickle
import re
from pathlib import Path
from typing import Any, Dict

from .record import HostRecord, RankRecord, Result

PREFIXED = re.compile(r"^\[rank(\d+)\]: ")


def build_result(run: Any, started: float, ended: float) -> Result:
    events = run.events.events()
    hosts: Dict[str, HostRecord] = {}
    for name, host in run.hosts.items():
        status = host.poll()
        host_rec = HostRecord(name, host.address)
        if status is not None:
            host_rec.exit_code, host_rec.signal = (status, None) if status >= 0 else (128 - status, -status)
        hosts[name] = host_rec
    ranks: Dict[int, RankRecord] = {}

    def rank(r: int, node: str) -> RankRecord:
        if r not in ranks:
            ranks[r] = RankRecord(r, node)
        return ranks[r]

    one_rank_per_host = run.job.launcher is None
    for e in events:
        if e.kind == "output":
            line = e.data["line"]
            if e.node in hosts:
                hosts[e.node].output.append(line)
            m = PREFIXED.match(line)
            if m:
                rank(int(m.group(1)), e.node).output.append(line[m.end():])
            continue
        if e.rank < 0:
            continue
        rec = rank(e.rank, e.node)
        rec.host = e.node
        if e.kind == "hello":
            rec.pids.append(e.pid)
            rec.restarts.append(int(e.data.get("restart", 0)))
            rec.world_sizes.append(int(e.data.get("world", -1)))
            rec.started = rec.started or e.t
        elif e.kind == "collective":
            rec.collectives += 1
            rec.last_collective = (e.data["n"], e.data["op"])
        elif e.kind == "exception":
            rec.exception_type, rec.exception_text, rec.exception_time = e.data["type"], e.data["text"], e.t
            rec.exception_bases = list(e.data.get("bases", ()))
        elif e.kind == "exit":
            rec.exited_cleanly = rec.exception_type is None
    for e in events:  # store operations: by the host the cluster named for them (its rank's)
        if e.kind == "store":
            for rec in ranks.values():
                if rec.host == e.node and (e.rank < 0 or e.rank == rec.rank):
                    rec.store_ops.append((e.t, e.data.get("op", "?"), tuple(e.data.get("keys", ()))))
    if one_rank_per_host:
        for rec in ranks.values():
            own = hosts.get(rec.host)
            if own is not None:
                rec.output = list(own.output)
                rec.exit_code, rec.signal = own.exit_code, own.signal
    for r, rank_rec in ranks.items():
        path = Path(run.dir, f"value-{r}.pkl")
        if path.exists():
            try:
                rank_rec.value = pickle.loads(path.read_bytes())
            except Exception as exc:  # noqa: BLE001 - a value that cannot be read back is said so
                rank_rec.value = f"<unreadable return value: {exc}>"
    return Result(hosts, ranks, events, run.faults, started, ended, run.hang, os.path.abspath(run.dir))
