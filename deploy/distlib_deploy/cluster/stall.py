"""What held a job that CLUSTER_TIMEOUT stopped, read from the containers' logs.

When `distlib cluster up` stops a job at CLUSTER_TIMEOUT, every container it stops exits with
the cluster's own SIGTERM (143): naming one of them "the first failure" blames a bystander.
What held the job is in the logs, and this module reads it (pure functions over log texts,
tested without an engine):

* a rank waiting for the others to join logs, every few seconds, how many joined and which
  ranks it still waits for (backends/join.py: ``pg0/gloo rank 0: 1/4 ranks joined after 5.0s;
  waiting for ranks 1, 2, 3 (timeout 30m00s)``): the latest such line names the ranks that
  never joined, and the rank that was still waiting;
* which container ran a rank: its launcher's summary (launcher/launch.py: ``node 1 of 4:
  starting 1 worker(s), global ranks 1..1 of 4``, at INFO), compose_node's node rank (always
  printed), or the rank's own ``[rankN]`` log lines;
* what a missing rank said last: a warning or an error if it logged one (a store it could not
  reach, store/tcp/connect.py), else its last line.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Tuple

#: backends/join.py's progress line of a rank that waits for the others to join.
JOIN_WAIT = re.compile(r"(?P<label>\S+) rank (?P<rank>\d+): (?P<joined>\d+)/(?P<size>\d+) ranks joined after "
                       r"(?P<after>\S+); waiting for ranks (?P<missing>[\d, ]+)(?: \(\+(?P<more>\d+) more\))? "
                       r"\(timeout")
#: launcher/launch.py's summary: the global ranks a node's launcher started (logged at INFO).
RANKS_STARTED = re.compile(r"node (?P<node>\d+) of \d+: starting \d+ worker\(s\), global ranks "
                           r"(?P<first>\d+)\.\.(?P<last>\d+) of \d+")
#: compose_node's node rank (modes rank0, file, nfs; always printed) and its distlib-run command.
NODE_RANK = re.compile(r"compose_node: mode \S+: node rank (?P<node>\d+) of \d+")
NPROC = re.compile(r"compose_node: exec distlib-run .*?--nproc-per-node (?P<nproc>\d+)")
#: distlib's log prefix of a rank's own lines (debug.py).
RANK_PREFIX = re.compile(r"^\[rank(?P<rank>\d+)\]", re.M)
#: A line worth quoting for a rank that never joined.
SAYS_WHY = re.compile(r"\b(WARNING|ERROR|CRITICAL)\b|Error: |error: ")
WIDTH = 400


@dataclass(frozen=True)
class Wait:
    """The latest progress line of a rank waiting for the others to join."""

    container: str
    rank: int
    joined: int
    size: int
    after: str
    missing: Tuple[int, ...]
    line: str


def latest_waits(logs: Mapping[str, str]) -> List[Wait]:
    """Per waiting rank, its latest join-progress line (rank order)."""
    waits: Dict[int, Wait] = {}
    for container, text in logs.items():
        for line in text.splitlines():
            match = JOIN_WAIT.search(line)
            if match:
                missing = tuple(int(r) for r in match.group("missing").replace(" ", "").split(",") if r)
                rank = int(match.group("rank"))
                waits[rank] = Wait(container, rank, int(match.group("joined")), int(match.group("size")),
                                   match.group("after"), missing, line.strip()[:WIDTH])
    return [waits[r] for r in sorted(waits)]


def container_of_ranks(logs: Mapping[str, str]) -> Dict[int, str]:
    """Global rank → the container that ran it: from the launcher's summary, from compose_node's
    node rank (times its --nproc-per-node), or from the rank's own prefixed log lines."""
    owner: Dict[int, str] = {}
    for container, text in logs.items():
        for match in RANK_PREFIX.finditer(text):
            owner[int(match.group("rank"))] = container
        node, nproc = NODE_RANK.search(text), NPROC.search(text)
        if node:
            per = int(nproc.group("nproc")) if nproc else 1
            for rank in range(int(node.group("node")) * per, (int(node.group("node")) + 1) * per):
                owner[rank] = container
        for match in RANKS_STARTED.finditer(text):
            for rank in range(int(match.group("first")), int(match.group("last")) + 1):
                owner[rank] = container
    return owner


def last_word(text: str) -> Optional[str]:
    """What a container said last that explains something: its last warning or error line, else
    its last line; None for an empty log."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        return None
    telling = [line for line in lines if SAYS_WHY.search(line)]
    return (telling or lines)[-1][:WIDTH]


def _ranks(ranks) -> str:
    ranks = list(ranks)
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


def held_by(logs: Mapping[str, str]) -> List[str]:
    """Sentences naming what held the job: the ranks that never joined (with their containers
    and what each said last) and the ranks still waiting for them; when no rank logged a wait,
    what each container said last. ``logs``: container name → its log."""
    waits = latest_waits(logs)
    owner = container_of_ranks(logs)
    if not waits:
        out = ["no rank logged a wait for the others (the job itself ran long, or hung before or after its "
               "rendezvous); what each container said last:"]
        for container, text in logs.items():
            out.append(f"{container} last said: {last_word(text) or '(nothing)'}")
        return out
    missing = sorted({r for w in waits for r in w.missing})
    newest = max(waits, key=lambda w: w.joined)
    out = [f"{_ranks(missing)} never joined: {newest.joined}/{newest.size} ranks joined, and "
           f"{_ranks(w.rank for w in waits)} waited for the rest"]
    for wait in waits:
        out.append(f"rank {wait.rank} ({wait.container}) was still waiting: {wait.line}")
    by_container: Dict[str, List[int]] = {}
    for rank in missing:
        by_container.setdefault(owner.get(rank, "?"), []).append(rank)
    for container, ranks in sorted(by_container.items()):
        if container == "?":
            out.append(f"{_ranks(ranks)}: no container's log says it ran them (see make cluster-logs)")
            continue
        said = last_word(logs.get(container, ""))
        out.append(f"{_ranks(ranks)} ({container}) last said: {said or '(nothing)'}")
    return out
