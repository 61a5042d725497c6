"""Elastic runs of the Compose cluster: ``MIN_NODES``/``MAX_RESTARTS`` (compose/elastic.yml),
``distlib cluster kill`` (``make cluster-kill NODE=2``), and the rounds (and the absences of
the store the job rode out) in the run's report.
``MAX_NODES`` (default ``NODES``) leaves room for worker containers started later, which join
at the next round.

``NODES=3 MIN_NODES=2 MAX_RESTARTS=3 make cluster-up`` runs the workers with ``distlib-run
--nnodes 2:3 --max-restarts 3`` (compose_node.py). Every agent prints one line per round
(``distlib-run: round 1 (restart 1 of at most 3): node lost: ...; now 2 node(s), world size 2``);
at the end ``up`` lists the rounds from the longest such record among the workers, with each
node's host name (a container's id) replaced by its Compose name, and does not count a worker
the job itself declared lost or gone as a failure when the others finished the job.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Tuple

from distlib.command import ToolError
from . import engine, state

COMPOSE_FILE = "elastic.yml"
#: Variables passed on to compose/elastic.yml as they are, when set.
PASSED_ON = ("RDZV_CONF", "CHECKPOINT_EVERY", "STEP_SECONDS")
#: An agent's line for a round (distlib/launcher/rounds.py round_line).
ROUND_LINE = re.compile(r"distlib-run: round (\d+) \(restart \d+ of at most \d+\): (.*); now (\d+) node\(s\), "
                        r"world size (\d+)")
#: An agent's line for an absence of the store the job rode out (rounds.outage_text).
AWAY_LINE = re.compile(r"distlib-run: the rendezvous store \((.*?)\) (was away for [\d.]+ s in round \d+ \(from [^)]*\): "
                       r"the job went on in the same round, no restart counted)")
#: The ways a cause names a node that left the job.
GONE = re.compile(r"node (?:lost|left|did not come back): (\S+) \(")


@dataclass(frozen=True)
class ElasticCluster:
    """The elastic settings of a cluster run, read from the environment."""

    min_nodes: int
    max_restarts: int
    #: the most nodes a round may have (MAX_NODES; default NODES): room for containers started later
    max_nodes: int = 0
    passed_on: Tuple[Tuple[str, str], ...] = ()

    @classmethod
    def from_env(cls, env: Mapping[str, str], nodes: int, mode: str) -> Optional["ElasticCluster"]:
        """None unless MIN_NODES or MAX_RESTARTS asks for an elastic job; ToolError (status 2) for bad values."""
        min_text = env.get("MIN_NODES", "").strip()
        restarts_text = env.get("MAX_RESTARTS", "").strip()
        max_text = env.get("MAX_NODES", "").strip()
        if not min_text and not restarts_text and not max_text:
            return None
        if max_text and (not max_text.isdigit() or int(max_text) < nodes):
            raise ToolError(f"MAX_NODES={max_text}: the most nodes a round may have, at least NODES={nodes}", 2)
        if min_text and (not min_text.isdigit() or not 1 <= int(min_text) <= nodes):
            raise ToolError(f"MIN_NODES={min_text}: the fewest nodes the job runs with, from 1 to NODES={nodes}", 2)
        if restarts_text and not restarts_text.isdigit():
            raise ToolError(f"MAX_RESTARTS={restarts_text}: the restarts the whole job may make, 0 or more", 2)
        if mode not in ("tcp", "file", "nfs"):
            raise ToolError(f"MIN_NODES/MAX_RESTARTS with MODE={mode}: an elastic job needs MODE=tcp (the master "
                            "service holds the rounds) or file/nfs (a shared file does)", 2)
        return cls(int(min_text) if min_text else nodes, int(restarts_text or "0"), int(max_text or nodes),
                   tuple((k, env[k]) for k in PASSED_ON if env.get(k, "").strip()))

    def compose_variables(self) -> Dict[str, str]:
        return {"MIN_NODES": str(self.min_nodes), "MAX_NODES": str(self.max_nodes),
                "MAX_RESTARTS": str(self.max_restarts), **dict(self.passed_on)}


def say(text: str) -> None:
    print(f"cluster: {text}", file=sys.stderr, flush=True)


# -- make cluster-kill ------------------------------------------------------------------------------------


def kill(state_dir, node: str) -> int:
    """SIGKILL worker ``node`` (its Compose number: ``worker-2`` is 2) of the last run."""
    if not node.strip().isdigit():
        raise ToolError(f"NODE={node!r}: the number of a worker container (worker-2 is NODE=2; make cluster-ps "
                        "lists them)", 2)
    run = state.load(state_dir)
    if run is None:
        raise ToolError(f"no cluster run recorded in {state_dir} (make cluster-up starts one)")
    client = engine.connect()
    workers = engine.project_containers(client, run.project, "worker")
    target = next((w for w in workers if engine.short_name(w) == f"worker-{int(node)}"), None)
    if target is None:
        names = ", ".join(sorted(engine.short_name(w) for w in workers)) or "none"
        raise ToolError(f"run {run.run_id} has no worker-{int(node)} (its workers: {names})")
    target.reload()
    if target.status != "running":
        raise ToolError(f"worker-{int(node)} ({target.name}) is not running ({target.status})")
    address = _address(target)
    target.kill()
    say(f"killed worker-{int(node)} ({target.name}, host {_hostname(target)}, {address}) with SIGKILL: the other "
        "nodes drop it after the heartbeat bound and go on in the next round")
    return 0


def _hostname(container) -> str:
    return (container.attrs.get("Config") or {}).get("Hostname") or container.id[:12]


def _address(container) -> str:
    networks = ((container.attrs.get("NetworkSettings") or {}).get("Networks") or {}).values()
    return next((n.get("IPAddress") for n in networks if n.get("IPAddress")), "no address")


# -- the rounds in the report ---------------------------------------------------------------------------------


def rounds_from_logs(logs: Dict[str, str]) -> List[Tuple[int, str, int, int]]:
    """(round, causes, nodes, world size) from the workers' logs: the longest record among them."""
    best: List[Tuple[int, str, int, int]] = []
    for text in logs.values():
        seen: Dict[int, Tuple[int, str, int, int]] = {}
        for m in ROUND_LINE.finditer(text):
            seen[int(m.group(1))] = (int(m.group(1)), m.group(2), int(m.group(3)), int(m.group(4)))
        if len(seen) > len(best):
            best = [seen[k] for k in sorted(seen)]
    return best


def absences_from_logs(logs: Dict[str, str]) -> List[Tuple[str, str]]:
    """(store, words) of each absence of the store the job rode out, as the agents listed them
    at the end (every node lists the same records: the longest list among them)."""
    best: List[Tuple[str, str]] = []
    for text in logs.values():
        found = list(dict.fromkeys((m.group(1), m.group(2)) for m in AWAY_LINE.finditer(text)))
        if len(found) > len(best):
            best = found
    return best


def conclude(workers: List[Any], judged: List[Any]) -> List[Any]:
    """Print the rounds; return ``judged`` without the workers the job declared gone."""
    for w in workers:
        w.reload()
    logs = {w.id: engine.logs_text(w) for w in workers}
    names = {_hostname(w): engine.short_name(w) for w in workers}
    record = rounds_from_logs(logs)
    if not record:
        say("elastic: no round was reported by any worker (see make cluster-logs)")
        return judged

    def named(text: str) -> str:
        for host, short in names.items():
            text = text.replace(f"{host} (", f"{short} ({host}, ")
        return text

    say(f"elastic: the job's rounds ({len(record)}):")
    for number, causes, nodes, world in record:
        print(f"cluster:   round {number}: {named(causes)} -> {nodes} node(s), world size {world}", file=sys.stderr)
    for store, words in absences_from_logs(logs):
        say(f"elastic: the rendezvous store ({store}) {words}")
    gone = {host for _n, causes, _k, _w in record for host in GONE.findall(causes)}
    lost = [w for w in judged if _hostname(w) in gone]
    for w in lost:
        status = w.attrs["State"].get("ExitCode")
        say(f"elastic: {engine.short_name(w)} ({w.name}) left the job (exit status {status}); the rounds above say "
            "why, and it is not counted as the job's failure")
    return [w for w in judged if w not in lost]
