"""The elastic job's state as the store holds it: JSON, its schema, and the check of every read.

Why a schema: the state lives in a store that anything reaching it can write to (a neighbour's
script, a typo in a key, an attacker without the token). Before an agent acts on a record, the
record must be one this code could have written: every field of the right type and range, the
phase one of the four, the round within ``--max-restarts``, every node named in a list known in
``nodes``. ``decode`` checks all of it and raises ``RecordError`` naming the field and what was
wrong with it; the agents then fail the job once with that sentence (rounds.decide), instead of
crashing on the first comparison of a string with a number. Every text is passed through
``printable`` on the way in, so no value read from the store can forge a line of output.

The schema (``FORMAT`` 1; every field required but ``cause_at`` and ``outages``, which agents
before them did not write; no other field):

==================  =====================================================================
``format``          1
``min``             integer >= 1: the fewest nodes of a round
``max``             integer >= ``min``
``max_restarts``    integer >= 0
``round``           integer, 0 <= round <= ``max_restarts``
``phase``           ``joining``, ``running``, ``succeeded`` or ``failed``
``joined``          node ids (distinct texts), at most ``max``, each in ``nodes``
``expected``        node ids (distinct)
``ranks``           node ids (distinct), at most ``max``, each in ``nodes``; running: at least one
``waiting``         node ids (distinct), each in ``nodes``
``done``            node ids (distinct), each in ``ranks``
``nodes``           {node id: [host name, address, pid >= 0, workers >= 1, node-rank hint >= 0 or null]}
``gone``            {node id: why}
``causes``          texts
``cause_at``        a finite number of seconds >= 0 (optional, 0)
``history``         [[round 0..``round``, causes, node ids, world size >= 0], ...]
``outcome``         text
``outages``         [[round 0..``round``, start: seconds since the epoch >= 0, seconds >= 0], ...],
                    at most ``rounds.MAX_OUTAGES`` (optional, [])
==================  =====================================================================
"""

from __future__ import annotations

import json
import math
from typing import Any, Dict, List, Mapping, Optional, Tuple

from ..printable import printable
from .rounds import FAILED, JOINING, MAX_OUTAGES, RUNNING, SUCCEEDED, JobState, NodeInfo, Outage, RoundRecord

FORMAT = 1
PHASES = (JOINING, RUNNING, SUCCEEDED, FAILED)
FIELDS = ("format", "min", "max", "max_restarts", "round", "phase", "joined", "expected", "ranks", "waiting",
          "done", "nodes", "gone", "causes", "cause_at", "history", "outcome", "outages")
#: Fields a record may lack: agents before them did not write them.
OPTIONAL = ("cause_at", "outages")
#: The longest value shown in an error (a record may be large).
SHOWN = 60


class RecordError(ValueError):
    """The bytes are not a state this code could have written (the message says what is wrong)."""


def encode(state: JobState) -> bytes:
    data = {
        "format": FORMAT, "min": state.min_nodes, "max": state.max_nodes, "max_restarts": state.max_restarts,
        "round": state.round, "phase": state.phase, "joined": state.joined, "expected": state.expected,
        "ranks": state.ranks, "waiting": state.waiting, "done": state.done,
        "nodes": {k: [v.name, v.addr, v.pid, v.nproc, v.hint] for k, v in state.nodes.items()},
        "gone": dict(state.gone), "causes": state.causes, "cause_at": state.cause_at,
        "history": [[r.number, r.causes, r.nodes, r.world_size] for r in state.history],
        "outcome": state.outcome,
        "outages": [[o.round, o.started, o.seconds] for o in state.outages],
    }
    return json.dumps(data, separators=(",", ":"), sort_keys=True).encode()


def decode(raw: bytes) -> JobState:
    """The state in ``raw``; RecordError naming the first field that breaks the schema."""
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise RecordError(f"not JSON ({type(exc).__name__}: {printable(str(exc))[:SHOWN]}): "
                          f"{_show(raw)}") from None
    if not isinstance(data, dict):
        raise RecordError(f"a JSON {type(data).__name__}, not an object: {_show(data)}")
    if data.get("format") != FORMAT:
        raise RecordError(f"format {_show(data.get('format'))}, expected {FORMAT}")
    unknown = sorted(str(k) for k in data if k not in FIELDS)
    if unknown:
        raise RecordError(f"unknown field(s) {', '.join(printable(k)[:SHOWN] for k in unknown)}")
    missing = [k for k in FIELDS if k not in data and k not in OPTIONAL]
    if missing:
        raise RecordError(f"missing field(s) {', '.join(missing)}")
    state = JobState(
        min_nodes=_int(data, "min", 1), max_nodes=_int(data, "max", 1), max_restarts=_int(data, "max_restarts", 0),
        round=_int(data, "round", 0), phase=_phase(data["phase"]), joined=_names(data, "joined"),
        expected=_names(data, "expected"), ranks=_names(data, "ranks"), waiting=_names(data, "waiting"),
        done=_names(data, "done"), nodes=_nodes(data["nodes"]), gone=_gone(data["gone"]),
        causes=_texts(data["causes"], "causes"), cause_at=_seconds(data.get("cause_at", 0.0), "field 'cause_at'"),
        history=_history(data["history"]), outcome=_text(data["outcome"], "outcome"),
        outages=_outages(data.get("outages", [])))
    _check_relations(state)
    return state


# -- fields ----------------------------------------------------------------------------------------


def _show(value: Any) -> str:
    text = value.decode("utf-8", "replace") if isinstance(value, bytes) else json.dumps(value) \
        if _jsonable(value) else repr(value)
    text = printable(text)
    return text if len(text) <= SHOWN else text[:SHOWN] + "..."


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError, RecursionError):
        return False
    return True


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _integer(value: Any, where: str, low: int, high: Optional[int] = None) -> int:
    if not _is_int(value) or value < low or (high is not None and value > high):
        bound = f"from {low} to {high}" if high is not None else f"of at least {low}"
        raise RecordError(f"{where} is {_show(value)}: expected an integer {bound}")
    return value


def _int(data: Mapping[str, Any], name: str, low: int) -> int:
    return _integer(data[name], f"field {name!r}", low)


def _phase(value: Any) -> str:
    if value not in PHASES or not isinstance(value, str):
        raise RecordError(f"field 'phase' is {_show(value)}: expected one of {', '.join(PHASES)}")
    return value


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise RecordError(f"{where} is {_show(value)}: expected a text")
    return printable(value)


def _texts(value: Any, where: str) -> Tuple[str, ...]:
    if not isinstance(value, list):
        raise RecordError(f"field {where!r} is {_show(value)}: expected a list of texts")
    return tuple(_text(v, f"an entry of {where!r}") for v in value)


def _names(data: Mapping[str, Any], name: str) -> Tuple[str, ...]:
    names = _texts(data[name], name)
    if len(set(names)) != len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise RecordError(f"field {name!r} names node(s) {', '.join(twice)[:SHOWN]} more than once")
    return names


def _seconds(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise RecordError(f"{where} is {_show(value)}: expected a number of seconds >= 0")
    return float(value)


def _nodes(value: Any) -> Dict[str, NodeInfo]:
    if not isinstance(value, dict):
        raise RecordError(f"field 'nodes' is {_show(value)}: expected an object of node id: [host, address, pid, "
                          "workers, hint]")
    out = {}
    for node, entry in value.items():
        where = f"node {printable(node)[:SHOWN]!r} in 'nodes'"
        if not isinstance(entry, list) or len(entry) != 5:
            raise RecordError(f"{where} is {_show(entry)}: expected [host, address, pid, workers, hint]")
        name, addr, pid, nproc, hint = entry
        out[printable(node)] = NodeInfo(
            _text(name, f"the host name of {where}"), _text(addr, f"the address of {where}"),
            _integer(pid, f"the pid of {where}", 0), _integer(nproc, f"the worker count of {where}", 1),
            None if hint is None else _integer(hint, f"the node-rank hint of {where}", 0))
    return out


def _gone(value: Any) -> Dict[str, str]:
    if not isinstance(value, dict):
        raise RecordError(f"field 'gone' is {_show(value)}: expected an object of node id: why")
    return {printable(node): _text(why, f"why node {printable(node)[:SHOWN]!r} is gone") for node, why in value.items()}


def _history(value: Any) -> Tuple[RoundRecord, ...]:
    if not isinstance(value, list):
        raise RecordError(f"field 'history' is {_show(value)}: expected a list of [round, causes, nodes, world size]")
    records: List[RoundRecord] = []
    for i, entry in enumerate(value):
        where = f"entry {i} of 'history'"
        if not isinstance(entry, list) or len(entry) != 4:
            raise RecordError(f"{where} is {_show(entry)}: expected [round, causes, nodes, world size]")
        number, causes, nodes, world = entry
        records.append(RoundRecord(_integer(number, f"the round of {where}", 0),
                                   _texts(causes, f"causes of {where}"), _texts(nodes, f"nodes of {where}"),
                                   _integer(world, f"the world size of {where}", 0)))
    return tuple(records)


def _outages(value: Any) -> Tuple[Outage, ...]:
    if not isinstance(value, list) or len(value) > MAX_OUTAGES:
        raise RecordError(f"field 'outages' is {_show(value)}: expected a list of at most {MAX_OUTAGES} "
                          "[round, start, seconds]")
    out = []
    for i, entry in enumerate(value):
        where = f"entry {i} of 'outages'"
        if not isinstance(entry, list) or len(entry) != 3:
            raise RecordError(f"{where} is {_show(entry)}: expected [round, start, seconds]")
        number, started, seconds = entry
        out.append(Outage(_integer(number, f"the round of {where}", 0), _seconds(started, f"the start of {where}"),
                          _seconds(seconds, f"the seconds of {where}")))
    return tuple(out)


# -- between fields --------------------------------------------------------------------------------


def _check_relations(state: JobState) -> None:
    if state.max_nodes < state.min_nodes:
        raise RecordError(f"field 'max' is {state.max_nodes}, below 'min' ({state.min_nodes})")
    if state.round > state.max_restarts:
        raise RecordError(f"field 'round' is {state.round}, above 'max_restarts' ({state.max_restarts}): a job "
                          "never has more rounds than restarts")
    for name in ("joined", "ranks"):
        members = getattr(state, name)
        if len(members) > state.max_nodes:
            raise RecordError(f"field {name!r} names {len(members)} nodes, more than 'max' ({state.max_nodes})")
    for name in ("joined", "ranks", "waiting"):
        unknown = [n for n in getattr(state, name) if n not in state.nodes]
        if unknown:
            raise RecordError(f"field {name!r} names node {unknown[0][:SHOWN]!r}, which 'nodes' does not describe")
    outsiders = [n for n in state.done if n not in state.ranks]
    if outsiders:
        raise RecordError(f"field 'done' names node {outsiders[0][:SHOWN]!r}, which is not in 'ranks'")
    if state.phase == RUNNING and not state.ranks:
        raise RecordError("field 'phase' is 'running' but 'ranks' is empty: a running round has nodes")
    for name, rounds in (("history", [r.number for r in state.history]), ("outages", [o.round for o in state.outages])):
        late = [r for r in rounds if r > state.round]
        if late:
            raise RecordError(f"{name!r} records round {late[0]}, after the current round {state.round}")
