"""What a finished run's containers say: which failed, which of them is the root cause, and the
lines of its log worth quoting. Pure functions over what the Docker API returns, so that they
are tested with real-shaped data and no engine.

The root cause is not simply the first container to exit: when a rank dies, its peers' next
collective fails at once and their containers often exit *before* the one that died. A peer
says so in its log (distlib's errors name the rank that "died, was killed, or destroyed its
process group", or the rank that "reported" a failure): such followers go last; the others are
ordered by the time they exited, as the engine recorded it.
"""

from __future__ import annotations

import datetime as dt
import re
from dataclasses import dataclass
from typing import Any, Iterable, List, Mapping, Optional, Tuple

#: A line by which a rank says that it failed because another one did.
FOLLOWER = re.compile(r"died, was killed, or destroyed its process group|\(reported by rank \d+")
#: Lines that say what happened: the job's FAILED line, the launcher's verdict, an error.
TELLING = re.compile(r"FAILED|worker failed|Error: |error: ")
#: The launcher's quotation of a worker's output (the worker's own line is quoted instead).
QUOTED_BY_LAUNCHER = "distlib-run:   |"

_RFC3339 = re.compile(r"(\d{4})-(\d\d)-(\d\d)T(\d\d):(\d\d):(\d\d)(?:\.(\d{1,9}))?(Z|[+-]\d\d:\d\d)$")


@dataclass(frozen=True, order=True)
class ExitTime:
    """When a container exited: ``at`` (UTC, to the microsecond) and the nanoseconds Docker
    records beyond it, so that two exits in one microsecond still sort."""

    at: dt.datetime
    nanos: int = 0


def parse_docker_time(text: str) -> ExitTime:
    """A Docker ``State.FinishedAt`` (RFC 3339 with up to 9 fraction digits, trailing zeros
    trimmed: ``2026-11-22T03:24:30.12Z``) as an ExitTime. ValueError for anything else."""
    match = _RFC3339.fullmatch(text.strip())
    if not match:
        raise ValueError(f"not a Docker time: {text!r}")
    year, month, day, hour, minute, second = (int(g) for g in match.groups()[:6])
    fraction, zone = match.group(7) or "", match.group(8)
    nanos = int(fraction) * 10 ** (9 - len(fraction)) if fraction else 0
    tz = dt.timezone.utc if zone == "Z" else dt.timezone(
        (1 if zone[0] == "+" else -1) * dt.timedelta(hours=int(zone[1:3]), minutes=int(zone[4:6])))
    at = dt.datetime(year, month, day, hour, minute, second, nanos // 1000, tzinfo=tz).astimezone(dt.timezone.utc)
    return ExitTime(at, nanos % 1000)


@dataclass(frozen=True)
class Failure:
    """A container that exited with a non-zero status."""

    name: str
    status: int
    finished: ExitTime
    follower: bool
    log: str


def failed_root_cause_first(containers: Iterable[Tuple[str, Mapping[str, Any], str]]) -> List[Failure]:
    """The containers among ``(name, State, log text)`` that exited non-zero, the root cause
    first: those whose log does not say a peer failed first, then the followers; each group
    by exit time (the name breaks ties)."""
    failed = []
    for name, state, log in containers:
        code = state.get("ExitCode")
        status = 1 if code is None else int(code)
        if status == 0:
            continue
        try:
            finished = parse_docker_time(state.get("FinishedAt") or "")
        except ValueError:
            finished = ExitTime(dt.datetime.max.replace(tzinfo=dt.timezone.utc))  # unknown: last
        failed.append(Failure(name, status, finished, bool(FOLLOWER.search(log)), log))
    return sorted(failed, key=lambda f: (f.follower, f.finished, f.name))


def telling_lines(log: str, keep: int = 4, width: int = 400, otherwise: int = 6) -> List[str]:
    """The last ``keep`` lines of a failed container's log that say what happened (cut to
    ``width``), else its last ``otherwise`` lines."""
    lines = [line for line in log.splitlines() if line.strip()]
    telling = [line[:width] for line in lines if TELLING.search(line) and not line.startswith(QUOTED_BY_LAUNCHER)]
    return telling[-keep:] if telling else [line[:width] for line in lines[-otherwise:]]


# -- MODE=mpi: what mpirun said -------------------------------------------------------------------

#: Open MPI's (PRRTE's) reports of the rank that ended the job; prterun wraps its text, so
#: words are separated by any white space.
_MPI_SIGNAL = re.compile(r"process\s+rank\s+(\d+)\s+with\s+PID\s+\d+\s+on\s+node\s+(\S+)\s+exited\s+on\s+signal\s+"
                         r"(\d+)(?:\s+\(([^)]*)\))?")
_MPI_STATUS = re.compile(r"one\s+or\s+more\s+processes\s+exited\s+with\s+non-zero\s+status.*?Process\s+name:\s+"
                         r"\[[^\]]*,(\d+)\]\s+Exit\s+code:\s+(\d+)", re.S)
_MPI_ABORT = re.compile(r"MPI_ABORT\s+was\s+invoked\s+on\s+rank\s+(\d+)\s+in\s+communicator\s+(\S+).*?"
                        r"Errorcode:\s+(\d+)", re.S)
_MPI_CALLED_ABORT = re.compile(r"process\s+rank\s+(\d+)\s+with\s+PID\s+\d+\s+on\s+node\s+(\S+)\s+calling\s+"
                               r"\"abort\"")
#: distlib's watchdog names the rank the others waited for (mpi backend, docs/mpi.md).
_MPI_NOT_THERE = re.compile(r"Not there: rank (\d+) \(host ([^)]+)\)")
#: mpi_launch's plan: ``mpi_launch: node K ADDRESS (NAME): rank R`` or ``ranks A-B``.
_MPI_NODE = re.compile(r"^mpi_launch: node (\d+) (\S+) \(([^)]*)\): ranks? (\d+)(?:-(\d+))?$", re.M)


@dataclass(frozen=True)
class RankFailure:
    """The rank that ended an MPI job, as mpirun (or distlib's watchdog) named it."""

    rank: int
    what: str
    node: str = ""  # the node as mpirun named it, when it did
    stalled: bool = False  # named by distlib's watchdog: alive, but not in the operation the others ran


def mpi_failed_rank(log: str) -> Optional[RankFailure]:
    """The rank mpirun blames in the launcher's ``log``: killed by a signal, exited non-zero,
    or called MPI_Abort (then the rank distlib's watchdog found missing, if it says, since the
    aborting rank only noticed the wait). None when mpirun named no rank."""
    match = _MPI_SIGNAL.search(log)
    if match:
        rank, node, signal, name = match.groups()
        return RankFailure(int(rank), f"killed by signal {signal}" + (f" ({name})" if name else ""), node)
    match = _MPI_STATUS.search(log)
    if match:
        return RankFailure(int(match.group(1)), f"exited with status {match.group(2)}")
    match = _MPI_ABORT.search(log)
    if match:
        absent = _MPI_NOT_THERE.search(log)
        if absent:
            return RankFailure(int(absent.group(1)), f"was not there when rank {match.group(1)}'s wait ran past the "
                                                     f"group timeout (distlib's watchdog; MPI_Abort error code "
                                                     f"{match.group(3)})", stalled=True)
        return RankFailure(int(match.group(1)), f"called MPI_Abort (error code {match.group(3)})")
    match = _MPI_CALLED_ABORT.search(log)
    if match:  # an MPI error its error handler made fatal (e.g. a peer's socket closed)
        return RankFailure(int(match.group(1)), "aborted the job", match.group(2))
    return None


def mpi_nodes(log: str) -> List[Tuple[str, str, int, int]]:
    """The launcher's plan from its ``log``: (address, name, first rank, last rank) per node."""
    out = []
    for _index, address, name, first, last in _MPI_NODE.findall(log):
        out.append((address, name, int(first), int(last or first)))
    return out


def mpi_node_of(rank: int, log: str) -> Optional[Tuple[str, str]]:
    """(address, name) of the worker that ran ``rank``, from the launcher's plan in ``log``."""
    for address, name, first, last in mpi_nodes(log):
        if first <= rank <= last:
            return address, name
    return None


def mpirun_lines(log: str, keep: int = 8) -> List[str]:
    """mpirun's own report of what ended the job: the lines of the first framed block
    (between lines of dashes) that names a process or rank, else the telling lines."""
    blocks: List[List[str]] = []
    current: List[str] = []
    inside = False
    for line in log.splitlines():
        if re.fullmatch(r"-{20,}", line.strip()):  # a frame's first or last line
            if inside and current:
                blocks.append(current)
            current, inside = [], not inside
            continue
        if inside and line.strip():
            current.append(line.rstrip())
    for block in blocks:
        if re.search(r"\brank\b|Process name", " ".join(block)):
            return block[:keep]
    return telling_lines(log)


def first_abnormal_end(records: Iterable[Mapping[str, Any]]) -> Optional[Mapping[str, Any]]:
    """Among the ranks' own records of how they ended (distlib_deploy.jobs.mpi_rank: rank, host,
    status or signal, time), the first that did not end with status 0; None if all did."""
    bad = [r for r in records if r.get("status") != 0 and isinstance(r.get("time"), (int, float))]
    return min(bad, key=lambda r: (r["time"], r.get("rank") if r.get("rank") is not None else -1), default=None)
