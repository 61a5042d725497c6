"""``resolve(flags, environ) -> Resolved``: the launcher's settings, each with its source.

One resolver for every convention a cluster may already provide (conventions.py), so the same
image runs unchanged under each. A pure function of its arguments (the machine's CPU/GPU
count and host name come through ``probe``), so every rule is unit-testable with env dicts.

Precedence, per setting: an explicit flag; else the first convention (in conventions.py
order) that gives a value; else torchrun's default. Every value carries the name of what it
came from, for ``--dry-run`` and for error messages.

Disagreements:

* a flag over an environment value: the flag wins, and a note says what it overrode;
* two environment sources on the *number of nodes* or the *node rank*: an error. Those decide
  every rank; picking one silently gives duplicate ranks or a rendezvous that never fills;
* two environment sources on the master's address or port, or the run id: a warning (the same
  host often goes by two names, e.g. ``localhost`` and a Service name).

Errors are ``ResolveError`` (a ValueError) with a message that names the values and their
sources.
"""

from __future__ import annotations

import dataclasses
import glob
import re
import socket
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, overload

from .. import settings
from ..cpus import usable_cpus
from . import conventions as conv
from .conventions import Candidate

#: torchrun's defaults (torch/distributed/run.py).
DEFAULT_MASTER_ADDR = "127.0.0.1"
DEFAULT_MASTER_PORT = 29500
DEFAULT_RUN_ID = "none"
#: The port of an --rdzv-endpoint given without one: `distlib store-server`'s default (torchrun's
#: c10d default is 29400; ours is the port the master service listens on by default).
DEFAULT_ENDPOINT_PORT = 29500
BACKENDS = ("static", "c10d")


class ResolveError(ValueError):
    """The flags and the environment do not make a launchable job (the message says why)."""


@dataclass
class Flags:
    """The launcher's flags as typed: raw text, ``None`` when not given."""

    nnodes: Optional[str] = None
    nproc_per_node: Optional[str] = None
    node_rank: Optional[str] = None
    master_addr: Optional[str] = None
    master_port: Optional[str] = None
    rdzv_backend: Optional[str] = None
    rdzv_endpoint: Optional[str] = None
    run_id: Optional[str] = None
    standalone: bool = False


FLAG_NAMES = {
    "nnodes": "--nnodes",
    "nproc_per_node": "--nproc-per-node",
    "node_rank": "--node-rank",
    "master_addr": "--master-addr",
    "master_port": "--master-port",
    "rdzv_backend": "--rdzv-backend",
    "rdzv_endpoint": "--rdzv-endpoint",
    "run_id": "--run-id",
}


class Value:
    """A resolved value and where it came from (``"flag --nnodes"``, ``"PET_NNODES"``, ...)."""

    __slots__ = ("value", "source")

    def __init__(self, value: Any, source: str):
        self.value = value
        self.source = source

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Value) and (self.value, self.source) == (other.value, other.source)

    def __repr__(self) -> str:
        return f"Value({self.value!r}, {self.source!r})"


@dataclass
class Resolved:
    """Everything the agent needs, each setting a ``Value``.

    ``master_addr``/``master_port`` name the store: rank 0's (static) or the master service
    (c10d, from the endpoint). ``node_rank.value`` is ``None`` for ``--node-rank auto`` until
    the agent has taken one (``with_node_rank``).
    """

    nnodes: Value
    nproc_per_node: Value
    node_rank: Value
    rdzv_backend: Value
    master_addr: Value
    master_port: Value
    run_id: Value
    init_method: Optional[Value] = None
    #: The fewest nodes a round may have (``--nnodes MIN:MAX``); None: as many as ``nnodes``.
    min_nodes: Optional[Value] = None
    #: ``--rdzv-endpoint file:///path``: the rendezvous is a FileStore at this path (no TCP store).
    rdzv_file: Optional[Value] = None
    extra_env: Dict[str, Value] = field(default_factory=dict)
    notes: List[str] = field(default_factory=list)
    warnings: List[str] = field(default_factory=list)

    @property
    def world_size(self) -> int:
        return self.nnodes.value * self.nproc_per_node.value

    @property
    def c10d(self) -> bool:
        return self.rdzv_backend.value == "c10d"

    @property
    def fewest_nodes(self) -> int:
        """MIN of ``--nnodes MIN:MAX`` (``nnodes`` itself for a fixed size)."""
        return self.min_nodes.value if self.min_nodes is not None else self.nnodes.value

    @property
    def node_rank_auto(self) -> bool:
        return self.node_rank.value is None

    @property
    def private_store(self) -> bool:
        """c10d with endpoint port 0: this agent hosts a store on a free port, for this run only."""
        return self.c10d and self.master_port.value == 0 and self.rdzv_file is None

    def with_node_rank(self, rank: int, source: str) -> "Resolved":
        return dataclasses.replace(self, node_rank=Value(rank, source))

    def with_master_port(self, port: int, source: str) -> "Resolved":
        return dataclasses.replace(self, master_port=Value(port, source))


# -- the machine, injectable ----------------------------------------------------------------------


@dataclass
class Probe:
    """What resolve needs from the machine; tests pass their own."""

    cpu_count: Callable[[], int]
    gpu_count: Callable[[Mapping[str, str]], Tuple[int, str]]
    hostname: Callable[[], str]


def _gpu_count(environ: Mapping[str, str]) -> Tuple[int, str]:
    """NVIDIA GPUs visible to the workers, without initialising CUDA in the launcher.

    CUDA_VISIBLE_DEVICES when set (entries up to the first invalid one, as CUDA reads it), else
    the /dev/nvidiaN device files (what the NVIDIA container runtime mounts for the GPUs a
    container was given).
    """
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        count = 0
        for entry in visible.split(","):
            entry = entry.strip()
            if not entry or entry.startswith("-"):
                break
            count += 1
        return count, f"CUDA_VISIBLE_DEVICES={visible!r}"
    devices = [d for d in glob.glob("/dev/nvidia*") if re.fullmatch(r"/dev/nvidia\d+", d)]
    return len(devices), f"{len(devices)} /dev/nvidiaN device file(s)"


def default_probe() -> Probe:
    return Probe(cpu_count=usable_cpus, gpu_count=_gpu_count, hostname=socket.gethostname)


# -- parsing helpers ------------------------------------------------------------------------------

_UNEXPANDED = re.compile(r"\$\((\w+)\)|\$\{(\w+)\}|^\$(\w+)$")


def _check_expanded(text: str, what: str, source: str) -> None:
    """Kubernetes leaves ``$(VAR)`` as it is when VAR is not defined in the container."""
    match = _UNEXPANDED.search(text)
    if match:
        var = next(g for g in match.groups() if g)
        raise ResolveError(
            f"{what} is {text!r} (from {source}): a variable reference nobody expanded. Kubernetes "
            f"keeps $({var}) literally when {var} is not defined in the container's env (before this "
            f"argument's use); a shell expands ${{{var}}} only when the command runs through a shell")


def _parse_int(text: str, what: str, source: str, minimum: int = 0, maximum: Optional[int] = None) -> int:
    _check_expanded(text, what, source)
    try:
        value = int(text)
    except ValueError:
        raise ResolveError(f"{what} must be an integer, got {text!r} (from {source})") from None
    if value < minimum or (maximum is not None and value > maximum):
        bound = f"between {minimum} and {maximum}" if maximum is not None else f"at least {minimum}"
        raise ResolveError(f"{what} must be {bound}, got {value} (from {source})")
    return value


def parse_nnodes_range(text: str, source: str) -> Tuple[int, int]:
    """``N`` → (N, N); torchrun's ``MIN:MAX`` → (MIN, MAX), an elastic job of MIN to MAX nodes."""
    _check_expanded(text, "the number of nodes", source)
    parts = text.split(":")
    if len(parts) == 2:
        low = _parse_int(parts[0], "the minimum number of nodes", source, 1)
        high = _parse_int(parts[1], "the maximum number of nodes", source, 1)
        if low > high:
            raise ResolveError(f"nnodes {text!r} (from {source}): MIN ({low}) is larger than MAX ({high})")
        return low, high
    if len(parts) != 1:
        raise ResolveError(f"nnodes {text!r} (from {source}) is not N or MIN:MAX")
    count = _parse_int(text, "the number of nodes", source, 1)
    return count, count


def _nnodes_shown(low: int, high: int):
    """N for a fixed size, "MIN:MAX" for a range: what a contradiction message shows."""
    return high if low == high else f"{low}:{high}"


def parse_nnodes(text: str, source: str) -> int:
    """The most nodes ``text`` allows (``N``, or MAX of ``MIN:MAX``)."""
    return parse_nnodes_range(text, source)[1]


def parse_nproc(text: str, source: str, probe: Probe, environ: Mapping[str, str]) -> Value:
    """torchrun's values: an integer, ``cpu``, ``gpu`` or ``auto`` (GPUs if any, else CPUs)."""
    _check_expanded(text, "nproc-per-node", source)
    kind = text.strip().lower()
    if kind in ("cpu", "gpu", "auto"):
        gpus, how = probe.gpu_count(environ) if kind != "cpu" else (0, "")
        if kind == "gpu" or (kind == "auto" and gpus > 0):
            if gpus < 1:
                raise ResolveError(f"nproc-per-node 'gpu' (from {source}): no GPU found ({how})")
            return Value(gpus, f"{source}: {text} -> {gpus} GPU(s) ({how})")
        cpus = probe.cpu_count()
        return Value(cpus, f"{source}: {text} -> {cpus} CPU(s)" + (f" (no GPU: {how})" if how else ""))
    if kind == "xpu":
        raise ResolveError(f"nproc-per-node 'xpu' (from {source}) is not supported: use a number, cpu, gpu or auto")
    try:
        value = int(text)
    except ValueError:
        raise ResolveError(
            f"nproc-per-node must be a number, cpu, gpu or auto, got {text!r} (from {source})") from None
    if value < 1:
        raise ResolveError(f"nproc-per-node must be at least 1, got {value} (from {source})")
    return Value(value, source)


def parse_endpoint(text: str, source: str) -> Tuple[str, Optional[int]]:
    """``host:port``, ``[v6]:port``, ``host`` or a bare IPv6 literal → (host, port or None)."""
    _check_expanded(text, "the rendezvous endpoint", source)
    text = text.strip()
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise ResolveError(f"endpoint {text!r} (from {source}) is not [IPv6]:port")
        port_text = rest[1:] if rest else ""
    elif text.count(":") == 1:
        host, port_text = text.split(":")
    else:
        host, port_text = text, ""
    if not host:
        raise ResolveError(f"endpoint {text!r} (from {source}) has no host")
    port = _parse_int(port_text, "the endpoint's port", source, 0, 65535) if port_text else None
    return host, port


def _strip_brackets(host: str) -> str:
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


# -- precedence -----------------------------------------------------------------------------------


@dataclass
class _Pick:
    chosen: Candidate
    others: List[Candidate]


def _flag(field_name: str, text: Optional[str], label: Optional[str] = None) -> Optional[Candidate]:
    if text is None:
        return None
    return Candidate(field_name, text, f"flag {label or FLAG_NAMES[field_name]}", "flag")


@overload
def _pick(field_name: str, flag: Optional[Candidate], readings: List[conv.Convention],
          default: str, extra: Tuple[Candidate, ...] = ()) -> _Pick: ...


@overload
def _pick(field_name: str, flag: Optional[Candidate], readings: List[conv.Convention],
          default: None, extra: Tuple[Candidate, ...] = ()) -> Optional[_Pick]: ...


def _pick(field_name: str, flag: Optional[Candidate], readings: List[conv.Convention],
          default: Optional[str], extra: Tuple[Candidate, ...] = ()) -> Optional[_Pick]:
    """The winning candidate for ``field_name`` and the ones it beat (flag, conventions, default)."""
    found: List[Candidate] = [c for c in (flag, *extra) if c is not None]
    found += [r.candidates[field_name] for r in readings if field_name in r.candidates]
    if default is not None:
        found.append(Candidate(field_name, default, "default", "default"))
    if not found:
        return None
    return _Pick(found[0], found[1:])


def _use(pick: _Pick) -> Candidate:
    if pick.chosen.error:
        raise ResolveError(pick.chosen.error)
    return pick.chosen


def _compare(pick: _Pick, chosen_value: Any, parse: Callable[[Candidate], Any], label: str,
             strict: bool, notes: List[str], warnings: List[str]) -> None:
    """Report the candidates ``pick.chosen`` beat that say something else (module docstring)."""
    chosen = pick.chosen
    for other in pick.others:
        if other.convention == "default" or other.error:
            continue
        try:
            value = parse(other)
        except ResolveError as exc:
            notes.append(f"{label}: {other.source}={other.value!r} not used ({exc})")
            continue
        if value == chosen_value:
            continue
        text = (f"{label}: {chosen.source} gives {chosen_value!r}, {other.source} gives {value!r} "
                f"({other.convention})")
        if chosen.convention == "flag":
            notes.append(f"{text}; the flag wins")
        elif other.convention == "flag":
            continue
        elif strict:
            raise ResolveError(
                f"the environment contradicts itself: {text}. Pass {FLAG_NAMES.get(chosen.field, label)} "
                "explicitly to say which is right")
        else:
            warnings.append(f"{text}; using {chosen.source}")


def resolve(flags: Flags, environ: Mapping[str, str], probe: Optional[Probe] = None) -> Resolved:
    """Resolve the launcher's settings from ``flags`` and ``environ`` (module docstring)."""
    probe = probe or default_probe()
    notes: List[str] = []
    warnings: List[str] = []
    hostname = environ.get("HOSTNAME") or probe.hostname()
    readings = conv.read_all(environ, hostname)
    for reading in readings:
        notes.extend(reading.notes)

    standalone = flags.standalone
    if standalone:
        if flags.nnodes is not None and parse_nnodes(flags.nnodes, "flag --nnodes") != 1:
            raise ResolveError("--standalone runs one node: drop --nnodes or make it 1")
        if flags.rdzv_endpoint is not None or (flags.rdzv_backend not in (None, "c10d")):
            notes.append("--standalone: --rdzv-backend/--rdzv-endpoint ignored (a private store on a free port)")

    # nnodes
    min_nodes = None
    if standalone:
        nnodes = Value(1, "flag --standalone")
    else:
        pick = _pick("nnodes", _flag("nnodes", flags.nnodes), readings, "1")
        chosen = _use(pick)
        low, high = parse_nnodes_range(chosen.text, chosen.source)
        nnodes = Value(high, chosen.source)
        min_nodes = Value(low, chosen.source)
        _compare(pick, _nnodes_shown(low, high), lambda c: _nnodes_shown(*parse_nnodes_range(c.text, c.source)),
                 "nnodes", True, notes, warnings)

    # nproc-per-node
    pick = _pick("nproc_per_node", _flag("nproc_per_node", flags.nproc_per_node), readings, "1")
    chosen = _use(pick)
    nproc = parse_nproc(chosen.text, chosen.source, probe, environ)
    if chosen.convention == "flag":
        _compare(pick, nproc.value, lambda c: parse_nproc(c.text, c.source, probe, environ).value,
                 "nproc-per-node", False, notes, warnings)

    # backend
    if standalone:
        backend = Value("c10d", "flag --standalone")
    else:
        pick = _pick("rdzv_backend", _flag("rdzv_backend", flags.rdzv_backend), readings, "static")
        chosen = _use(pick)
        name = chosen.text.strip().lower()
        if name not in BACKENDS:
            raise ResolveError(
                f"rendezvous backend {chosen.text!r} (from {chosen.source}) is not supported: use static "
                "(rank 0 hosts the store) or c10d (a distlib store-server at --rdzv-endpoint)")
        backend = Value(name, chosen.source)

    # where the store is
    rdzv_file = _file_endpoint(flags, readings, backend)
    if rdzv_file is not None:
        master_addr = Value("", f"{rdzv_file.source}: none, the rendezvous is a FileStore")
        master_port = Value(0, master_addr.source)
    else:
        master_addr, master_port = _resolve_master(flags, readings, backend, standalone, notes, warnings)

    # node rank
    node_rank = _resolve_node_rank(flags, readings, nnodes, backend, standalone, notes)

    # run id
    pick = _pick("run_id", _flag("run_id", flags.run_id), readings, DEFAULT_RUN_ID)
    chosen = _use(pick)
    _check_expanded(chosen.text, "the run id", chosen.source)
    run_id = Value(chosen.text, chosen.source)
    _compare(pick, run_id.value, lambda c: c.text, "run id", False, notes, warnings)

    # init method: the job's own (e.g. the Helm chart's file mode); no TCP store then
    init_method = None
    text = settings.init_method(environ)
    if text:
        init_method = Value(text, "DISTLIB_INIT_METHOD")
        if node_rank.value is None:
            raise ResolveError(
                f"--node-rank auto takes node ranks from the master service, but DISTLIB_INIT_METHOD={text!r} "
                "says this job uses no TCP store: give each node its rank (--node-rank N)")
        if rdzv_file is not None:
            raise ResolveError(
                f"DISTLIB_INIT_METHOD={text!r} and --rdzv-endpoint {rdzv_file.value} both say where the job meets: "
                "drop DISTLIB_INIT_METHOD (with a file:// endpoint the launcher gives every round its own store file)")
        if backend.value == "c10d":
            notes.append(f"DISTLIB_INIT_METHOD={text!r} is set: the job rendezvous through it; the launcher "
                         "neither starts nor contacts the c10d endpoint")

    if backend.value == "c10d" and run_id.source == "default" and not (master_port.value == 0 and rdzv_file is None):
        warnings.append(
            f"run id {DEFAULT_RUN_ID!r} (the default): runs that share a master service need distinct ids, "
            "or their keys meet; pass --run-id (or set DISTLIB_RUN_ID)")

    extra_env: Dict[str, Value] = {}
    if nproc.value > 1 and "OMP_NUM_THREADS" not in environ:
        extra_env["OMP_NUM_THREADS"] = Value("1", "default for nproc-per-node > 1 (as torchrun)")
        warnings.append(
            "setting OMP_NUM_THREADS=1 for each worker (it is unset and several workers share this node), "
            "to avoid overloading the machine; set it yourself to tune")

    return Resolved(
        nnodes=nnodes, nproc_per_node=nproc, node_rank=node_rank, rdzv_backend=backend,
        master_addr=master_addr, master_port=master_port, run_id=run_id, init_method=init_method,
        min_nodes=min_nodes, rdzv_file=rdzv_file, extra_env=extra_env, notes=notes, warnings=warnings,
    )


def _file_endpoint(flags: Flags, readings: List[conv.Convention], backend: Value) -> Optional[Value]:
    """``--rdzv-endpoint file:///path`` (c10d): the path of the FileStore that holds the rendezvous."""
    pick = _pick("rdzv_endpoint", _flag("rdzv_endpoint", flags.rdzv_endpoint), readings, None)
    if pick is None or pick.chosen.error or not pick.chosen.text.strip().lower().startswith("file:"):
        return None
    chosen = pick.chosen
    text = chosen.text.strip()
    _check_expanded(text, "the rendezvous endpoint", chosen.source)
    if backend.value != "c10d":
        raise ResolveError(f"rendezvous endpoint {text!r} (from {chosen.source}) is a file: it needs --rdzv-backend "
                           "c10d (static means rank 0's host and port)")
    if not text.startswith("file://") or not text[len("file://"):].startswith("/"):
        raise ResolveError(f"rendezvous endpoint {text!r} (from {chosen.source}) is not file:///ABSOLUTE/PATH "
                           "(three slashes: the path of the store file every node shares)")
    path = text[len("file://"):]
    if path.endswith("/"):
        raise ResolveError(f"rendezvous endpoint {text!r} (from {chosen.source}) names a directory: give the store "
                           "file's path, e.g. file:///shared/job-7/rdzv")
    return Value(path, chosen.source)


def _resolve_master(flags: Flags, readings: List[conv.Convention], backend: Value, standalone: bool,
                    notes: List[str], warnings: List[str]) -> Tuple[Value, Value]:
    """Where the store is: the c10d endpoint, or (static) where global rank 0 hosts it."""
    if standalone:
        return Value("127.0.0.1", "flag --standalone"), Value(0, "flag --standalone (a free port)")

    endpoint_flag = _flag("rdzv_endpoint", flags.rdzv_endpoint)
    endpoint_pick = _pick("rdzv_endpoint", endpoint_flag, readings, None)

    if backend.value == "c10d":
        if endpoint_pick is None:
            raise ResolveError(
                "--rdzv-backend c10d needs --rdzv-endpoint HOST[:PORT]: where the distlib store-server "
                "(the master service) listens")
        chosen = _use(endpoint_pick)
        host, port = parse_endpoint(chosen.text, chosen.source)
        for name in ("master_addr", "master_port"):
            if getattr(flags, name) is not None:
                warnings.append(f"{FLAG_NAMES[name]} is only used with --rdzv-backend static; the c10d "
                                f"workers use the endpoint {chosen.text}")
        port_value = Value(port if port is not None else DEFAULT_ENDPOINT_PORT,
                           chosen.source if port is not None else "default for an endpoint without a port")
        return Value(_strip_brackets(host), chosen.source), port_value

    # static: --master-addr/--master-port, or an endpoint (torchrun uses it as the master then)
    ep_host = ep_port = None
    if endpoint_pick is not None:
        chosen = _use(endpoint_pick)
        host, port = parse_endpoint(chosen.text, chosen.source)
        ep_host = Candidate("master_addr", host, chosen.source, chosen.convention)
        if port is not None:
            ep_port = Candidate("master_port", str(port), chosen.source, chosen.convention)

    def ordered(field_name: str, ep: Optional[Candidate]) -> List[Candidate]:
        flag = _flag(field_name, getattr(flags, field_name))
        found = [c for c in (flag,) if c is not None]
        if ep is not None and ep.convention == "flag":
            found.append(ep)
        if ep is not None and ep.convention != "flag":
            # an endpoint from PET_RDZV_ENDPOINT comes right after PET_MASTER_*
            pet = [r.candidates[field_name] for r in readings[:1] if field_name in r.candidates]
            rest = [r.candidates[field_name] for r in readings[1:] if field_name in r.candidates]
            return found + pet + [ep] + rest
        return found + [r.candidates[field_name] for r in readings if field_name in r.candidates]

    addr_found = ordered("master_addr", ep_host) + [
        Candidate("master_addr", DEFAULT_MASTER_ADDR, "default", "default")]
    port_found = ordered("master_port", ep_port) + [
        Candidate("master_port", str(DEFAULT_MASTER_PORT), "default", "default")]

    addr_pick = _Pick(addr_found[0], addr_found[1:])
    chosen = _use(addr_pick)
    _check_expanded(chosen.text, "the master address", chosen.source)
    addr = Value(_strip_brackets(chosen.text.strip()), chosen.source)
    _both_flags_agree(addr_pick, addr.value, lambda c: _strip_brackets(c.text.strip()), "master address")
    _compare(addr_pick, addr.value, lambda c: _strip_brackets(c.text.strip()), "master address", False, notes,
             warnings)

    port_pick = _Pick(port_found[0], port_found[1:])
    chosen = _use(port_pick)
    master_port = Value(_parse_int(chosen.text, "the master port", chosen.source, 0, 65535), chosen.source)
    parse_port = lambda c: _parse_int(c.text, "the master port", c.source, 0, 65535)  # noqa: E731
    _both_flags_agree(port_pick, master_port.value, parse_port, "master port")
    _compare(port_pick, master_port.value, parse_port, "master port", False, notes, warnings)
    if master_port.value == 0:
        raise ResolveError(
            f"master port 0 (from {master_port.source}) cannot work with --rdzv-backend static: every worker must "
            "know rank 0's port in advance. Pick a port, or use --standalone / --rdzv-backend c10d "
            "--rdzv-endpoint 127.0.0.1:0 on a single node")
    return addr, master_port


def _both_flags_agree(pick: _Pick, value: Any, parse: Callable[[Candidate], Any], label: str) -> None:
    """--master-addr/--master-port and --rdzv-endpoint both given: they must say the same."""
    if pick.chosen.convention != "flag":
        return
    for other in pick.others:
        if other.convention == "flag" and parse(other) != value:
            raise ResolveError(
                f"{label}: {pick.chosen.source} says {value!r} but {other.source} says {parse(other)!r}; "
                "give one of them")


def _resolve_node_rank(flags: Flags, readings: List[conv.Convention], nnodes: Value, backend: Value,
                       standalone: bool, notes: List[str]) -> Value:
    if standalone:
        return Value(0, "flag --standalone")
    pick = _pick("node_rank", _flag("node_rank", flags.node_rank), readings, "0")
    chosen = _use(pick)
    text = chosen.text.strip()
    if text.lower() == "auto":
        if chosen.convention != "flag":
            raise ResolveError(f"node rank 'auto' is only accepted as a flag (got it from {chosen.source})")
        if backend.value != "c10d":
            raise ResolveError(
                "--node-rank auto needs --rdzv-backend c10d: node ranks are handed out by the master service "
                "(a distlib store-server at --rdzv-endpoint); with static, the store lives in global rank 0, "
                "which cannot exist before node ranks are known")
        return Value(None, "flag --node-rank auto (taken from the master service at launch)")
    rank = _parse_int(text, "the node rank", chosen.source, 0)
    if rank >= nnodes.value:
        raise ResolveError(
            f"node rank {rank} (from {chosen.source}) is out of range for {nnodes.value} node(s) "
            f"(nnodes from {nnodes.source}): node ranks are 0..{nnodes.value - 1}"
            + ("; pass --nnodes (an Indexed Job does not tell its pods the number of completions)"
               if nnodes.source == "default" else ""))
    value = Value(rank, chosen.source)
    _compare(pick, rank, lambda c: _parse_int(c.text.strip(), "the node rank", c.source, 0), "node rank", True,
             notes, [])
    return value
