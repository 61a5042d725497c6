"""What every distlib benchmark shares: child processes, timing, statistics, rows with
targets, the aligned table and the JSON report.

Conventions (both benchmarks follow them, so their outputs read the same):

* Each measured load runs in child processes (``Child``), never in the process that prints:
  a benchmark compares implementations, and each gets fresh processes with nothing of the
  other's state in them. A child that fails surfaces its traceback (``ChildError``); every
  wait on a child has a timeout.
* Implementations run interleaved, round by round (distlib, torch, distlib, torch, ...), so a
  slow phase of a noisy machine hits both; a row reports the **median over rounds**.
* A ``Row`` holds one figure per implementation per round. Its ``speedup`` is always "how
  many times better distlib is than the reference" (ops/s: distlib / torch; times: torch /
  distlib), so > 1 means distlib is ahead whatever the unit.
* A ``Target`` is either a minimum speed-up over the reference or an absolute bound on
  distlib's figure; ``Row.result`` says PASS, MISS or n/a (not measurable in this run). The
  targets themselves are data, ``targets.json`` beside this module (``load_targets``): what a
  benchmark must reach is decided by whoever asks for it, not by the code that measures.
"""

from __future__ import annotations

import datetime
import gc
import io
import json
import math
import multiprocessing
import os
import platform
import random
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

DISTLIB, TORCH = "distlib", "torch"

#: Children are forked: the parent imports what they need once (torch takes seconds), and a
#: fork starts in milliseconds. The parent must not run threads when it forks.
_CTX = multiprocessing.get_context("fork")


class BenchError(RuntimeError):
    """A benchmark could not run a load (a child failed, hung or sent nonsense)."""


class ChildError(BenchError):
    """A child process raised; the message carries its traceback."""


# -- child processes ---------------------------------------------------------------------------


def _child_main(target: Callable, conn, args: tuple) -> None:
    try:
        result = target(conn, *args)
    except BaseException:  # noqa: BLE001 - the parent shows it
        try:
            conn.send(("error", traceback.format_exc()))
        except Exception:  # noqa: BLE001 - the parent is gone
            pass
        os._exit(1)
    try:
        conn.send(("done", result))
    except Exception:  # noqa: BLE001
        pass
    conn.close()


class Child:
    """``target(conn, *args)`` in a forked process, talking to the parent over a pipe.

    The target may ``conn.send`` messages (``recv`` returns them) and ``conn.recv`` the
    parent's; its return value arrives as the last message (``result``). An exception in
    the child is re-raised here as ChildError with the child's traceback.
    """

    def __init__(self, target: Callable, *args: Any, name: Optional[str] = None):
        self.name = name or getattr(target, "__name__", "child")
        # Objects that exist now stay out of the cyclic GC's reach, in the parent and in the
        # child: a collection in the child would otherwise touch (and copy) every page of
        # the parent's heap, a cost of forking that no measured implementation should pay.
        gc.freeze()
        self._conn, child_conn = _CTX.Pipe()
        self.proc = _CTX.Process(target=_child_main, args=(target, child_conn, args), name=self.name, daemon=True)
        self.proc.start()
        child_conn.close()
        self._result: Any = None
        self._finished = False

    @property
    def pid(self) -> Optional[int]:
        return self.proc.pid

    def send(self, obj: Any) -> None:
        self._conn.send(obj)

    def recv(self, timeout: float) -> Any:
        """The child's next message. Raises ChildError if it failed, BenchError on timeout
        or if it finished instead (its result is kept for ``result``)."""
        if self._finished:
            raise BenchError(f"{self.name} (pid {self.pid}) has already finished")
        kind, rest = self._next(timeout, f"sent nothing within {timeout:.0f} s", "without a word")
        if kind == "done":
            raise BenchError(f"{self.name} (pid {self.pid}) finished while a message was expected")
        return rest[0] if len(rest) == 1 else tuple(rest)

    def result(self, timeout: float) -> Any:
        """Wait for the child to finish; its return value. Messages it sends first are
        skipped."""
        deadline = time.monotonic() + timeout
        while not self._finished:
            self._next(deadline - time.monotonic(), f"did not finish within {timeout:.0f} s", "without a result")
        self.proc.join(timeout=max(1.0, deadline - time.monotonic()))
        return self._result

    def _next(self, timeout: float, late: str, silent: str) -> Tuple[str, list]:
        """One message from the child, as (kind, rest). A failure is raised (ChildError); a
        result ("done") is kept and ends the child. ``late`` and ``silent`` finish the
        errors for a timeout and for an exit without a message."""
        if timeout <= 0 or not self._conn.poll(timeout):
            raise BenchError(f"{self.name} (pid {self.pid}) {late}"
                             + ("" if self.proc.is_alive() else f"; it exited with {self.proc.exitcode}"))
        try:
            kind, *rest = self._conn.recv()
        except EOFError:
            self.proc.join(5)
            raise BenchError(f"{self.name} (pid {self.pid}) exited with {self.proc.exitcode} {silent}") from None
        if kind == "error":
            self._finished = True
            raise ChildError(f"{self.name} (pid {self.pid}) failed:\n{rest[0]}")
        if kind == "done":
            self._finished = True
            self._result = rest[0]
        return kind, rest

    def stop(self, timeout: float = 5.0) -> None:
        """Ask politely (a "stop" message), then terminate, then kill."""
        if self.proc.is_alive():
            try:
                self._conn.send(("stop",))
            except (OSError, ValueError):
                pass
            self.proc.join(timeout)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(timeout)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout)
        self._conn.close()

    def __enter__(self) -> "Child":
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()


def run_child(target: Callable, *args: Any, timeout: float, name: Optional[str] = None) -> Any:
    """Run ``target(conn, *args)`` in a child and return its result."""
    child = Child(target, *args, name=name)
    try:
        return child.result(timeout)
    finally:
        child.stop()


# -- timing --------------------------------------------------------------------------------------


def sleep_until(when: float, clock: Callable[[], float] = time.perf_counter) -> None:
    """Sleep until ``clock() >= when`` (one shared instant for many processes: on Linux
    perf_counter is CLOCK_MONOTONIC, the same in every process); the last ms is spun."""
    while True:
        left = when - clock()
        if left <= 0:
            return
        if left > 0.002:
            time.sleep(left - 0.001)


@dataclass
class LoopResult:
    """``ops`` calls in ``seconds``; ``latencies`` (seconds per call) when recorded."""

    ops: int
    seconds: float
    latencies: List[float] = field(default_factory=list)

    @property
    def rate(self) -> float:
        return self.ops / self.seconds if self.seconds > 0 else float("nan")

    def latency_quantile(self, q: float) -> float:
        return quantile(self.latencies, q) if self.latencies else float("nan")


def timed_loop(fn: Callable[[int], Any], seconds: float, batch: int = 64,
               record: bool = True, min_ops: int = 1) -> LoopResult:
    """Call ``fn(i)`` for i = 0, 1, ... for about ``seconds`` (checked every ``batch`` calls,
    at least ``min_ops`` calls), timing each call when ``record``."""
    clock = time.perf_counter
    latencies: List[float] = []
    lat_append = latencies.append
    n = 0
    start = clock()
    end = start + seconds
    while True:
        if record:
            for _ in range(batch):
                t0 = clock()
                fn(n)
                lat_append(clock() - t0)
                n += 1
        else:
            for _ in range(batch):
                fn(n)
                n += 1
        if n >= min_ops and clock() >= end:
            break
    return LoopResult(n, clock() - start, latencies)


# -- statistics ----------------------------------------------------------------------------------


def quantile(values: Sequence[float], q: float) -> float:
    """The q-quantile (0..1) by linear interpolation; NaN for no values."""
    data = sorted(v for v in values if v is not None and not math.isnan(v))
    if not data:
        return float("nan")
    if len(data) == 1:
        return data[0]
    pos = q * (len(data) - 1)
    lo = int(math.floor(pos))
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def median(values: Sequence[float]) -> float:
    return quantile(values, 0.5)


def spread(values: Sequence[float]) -> float:
    """max/min - 1 over the rounds (0.25 = the best round was 25% above the worst)."""
    data = [v for v in values if v is not None and not math.isnan(v) and v > 0]
    if len(data) < 2:
        return 0.0
    return max(data) / min(data) - 1


@dataclass
class PairedRatio:
    """The median of per-pair ratios and a 95% bootstrap interval around it."""

    median: float
    low: float
    high: float
    pairs: int

    def to_json(self) -> Dict[str, Any]:
        return {"median": _json_num(self.median), "ci95": [_json_num(self.low), _json_num(self.high)],
                "pairs": self.pairs}


def paired_ratio(numerators: Sequence[float], denominators: Sequence[float], resamples: int = 2000,
                 seed: int = 0) -> PairedRatio:
    """Median of ``numerators[i] / denominators[i]`` with a 95% percentile-bootstrap interval.

    For loads whose speed drifts by tens of percent within seconds on a shared VM: two
    implementations measured back to back form a pair that saw the same machine, so the
    ratio within each pair cancels the drift that separate medians keep. The fixed seed makes
    a report reproducible from its own numbers.
    """
    ratios = [a / b for a, b in zip(numerators, denominators) if a > 0 and b > 0]
    if not ratios:
        nan = float("nan")
        return PairedRatio(nan, nan, nan, 0)
    rng = random.Random(seed)
    n = len(ratios)
    boots = sorted(median([ratios[rng.randrange(n)] for _ in range(n)]) for _ in range(resamples))
    return PairedRatio(median(ratios), quantile(boots, 0.025), quantile(boots, 0.975), n)


def histogram(values: Iterable[float], edges: Sequence[Tuple[float, str]]) -> Dict[str, int]:
    """Count values into labelled buckets: ``edges`` = [(upper bound, label), ...] in
    increasing order; values at or over the last bound go into the last label."""
    counts = {label: 0 for _, label in edges}
    last = edges[-1][1]
    for value in values:
        for bound, label in edges:
            if value < bound:
                counts[label] += 1
                break
        else:
            counts[last] += 1
    return {label: n for label, n in counts.items() if n}


# -- rows, targets and results -------------------------------------------------------------------


@dataclass
class Target:
    """What a row must reach: ``min_speedup`` over the reference, distlib's value within
    ``max_value`` (lower is better) / at least ``min_value`` (higher is better), or at most
    ``max_excess`` above the reference's value (lower is better: a fixed overhead per call)."""

    text: str
    min_speedup: Optional[float] = None
    max_value: Optional[float] = None
    min_value: Optional[float] = None
    max_excess: Optional[float] = None

    def to_json(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {"text": self.text}
        for name in _BOUNDS:
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return out


#: The acceptance targets of every benchmark (see load_targets).
TARGETS_FILE = Path(__file__).with_name("targets.json")
_BOUNDS = ("min_speedup", "max_value", "min_value", "max_excess")


def load_targets(benchmark: str, path: Path = TARGETS_FILE) -> Dict[str, Any]:
    """``benchmark``'s section of the targets file, with every target (a mapping of ``text``
    and one bound) turned into a ``Target``; ``applies`` mappings (which rows carry a target)
    stay as they are. BenchError, naming the file and the entry, when the file is unreadable
    or an entry is malformed."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise BenchError(f"cannot read the benchmark targets {path}: {exc}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get(benchmark), dict):
        raise BenchError(f"{path} has no targets for {benchmark!r}")
    return _targets(doc[benchmark], benchmark, path)


def _targets(node: Any, where: str, path: Path) -> Any:
    if isinstance(node, dict) and "text" in node:
        bounds = {k: node[k] for k in _BOUNDS if k in node}
        numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in bounds.values())
        if len(bounds) != 1 or not numbers or set(node) - {"text", *_BOUNDS} or not isinstance(node["text"], str):
            raise BenchError(f"{path}: {where}: a target is a text and one number of "
                             f"{', '.join(_BOUNDS)}; got {json.dumps(node)}")
        return Target(node["text"], **{k: float(v) for k, v in bounds.items()})
    if isinstance(node, dict):
        return {k: v if k == "applies" else _targets(v, f"{where}.{k}", path) for k, v in node.items()}
    raise BenchError(f"{path}: {where}: expected a target or a mapping of them; got {json.dumps(node)}")


PASS, MISS, NOT_MEASURED = "PASS", "MISS", "n/a"


@dataclass
class Row:
    """One line of a result table: a figure per implementation per round."""

    section: str
    name: str
    unit: str  # "ops/s", "s", "us/entry", ...
    higher_is_better: bool
    target: Optional[Target] = None
    note: str = ""
    values: Dict[str, List[float]] = field(default_factory=dict)
    details: Dict[str, List[Dict[str, Any]]] = field(default_factory=dict)
    errors: Dict[str, str] = field(default_factory=dict)

    def add(self, impl: str, value: float, **details: Any) -> None:
        self.values.setdefault(impl, []).append(value)
        self.details.setdefault(impl, []).append(details)

    def fail(self, impl: str, error: str) -> None:
        self.errors[impl] = error

    def median(self, impl: str) -> float:
        return median(self.values.get(impl, []))

    def speedup(self, impl: str = "distlib", reference: str = "torch") -> float:
        ours, theirs = self.median(impl), self.median(reference)
        if math.isnan(ours) or math.isnan(theirs) or ours <= 0 or theirs <= 0:
            return float("nan")
        return ours / theirs if self.higher_is_better else theirs / ours

    def excess(self, impl: str = "distlib", reference: str = "torch") -> float:
        """How much more ``impl``'s median is than the reference's (lower-is-better units: the
        fixed cost distlib adds to a call); NaN unless both were measured."""
        if reference in self.errors or impl in self.errors:
            return float("nan")
        ours, theirs = self.median(impl), self.median(reference)
        return float("nan") if math.isnan(ours) or math.isnan(theirs) else ours - theirs

    def result(self, impl: str = "distlib", reference: str = "torch") -> str:
        target = self.target
        if target is None:
            return ""
        if impl in self.errors:
            return MISS
        if target.min_speedup is not None:
            ratio = self.speedup(impl, reference)
            return NOT_MEASURED if math.isnan(ratio) else (PASS if ratio >= target.min_speedup else MISS)
        if target.max_excess is not None:
            excess = self.excess(impl, reference)
            return NOT_MEASURED if math.isnan(excess) else (PASS if excess <= target.max_excess else MISS)
        value = self.median(impl)
        if math.isnan(value):
            return NOT_MEASURED
        if target.max_value is not None and value > target.max_value:
            return MISS
        if target.min_value is not None and value < target.min_value:
            return MISS
        return PASS

    def to_json(self, impls: Sequence[str], reference: str = "torch") -> Dict[str, Any]:
        out: Dict[str, Any] = {
            "section": self.section, "name": self.name, "unit": self.unit,
            "higher_is_better": self.higher_is_better,
        }
        for impl in impls:
            vals = self.values.get(impl)
            entry: Dict[str, Any] = {"median": _json_num(self.median(impl)) if vals else None,
                                     "rounds": [_json_num(v) for v in vals or []],
                                     "spread": _json_num(spread(vals or [])),
                                     "details": self.details.get(impl, [])}
            if impl in self.errors:
                entry["error"] = self.errors[impl]
            out[impl] = entry
        out["speedup"] = _json_num(self.speedup(impls[0], reference)) if reference in impls else None
        out["target"] = self.target.to_json() if self.target else None
        out["result"] = self.result(impls[0], reference) or None
        if self.note:
            out["note"] = self.note
        return out


def _json_num(x: float) -> Optional[float]:
    if x is None or (isinstance(x, float) and (math.isnan(x) or math.isinf(x))):
        return None
    return round(x, 9) if isinstance(x, float) else x


# -- formatting ----------------------------------------------------------------------------------


def fmt_num(x: Optional[float]) -> str:
    """12,345 / 123 / 12.3 / 1.23 / 0.123 (three significant digits below 1000)."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    ax = abs(x)
    if ax >= 1000:
        return f"{x:,.0f}"
    if ax >= 100:
        return f"{x:.0f}"
    if ax >= 10:
        return f"{x:.1f}"
    if ax >= 1:
        return f"{x:.2f}"
    return f"{x:.3g}"


def fmt_seconds(s: Optional[float]) -> str:
    """A duration with a unit picked for it: 45.2 us, 3.41 ms, 25.1 s."""
    if s is None or (isinstance(s, float) and math.isnan(s)):
        return "-"
    if s < 1e-3:
        return f"{fmt_num(s * 1e6)} us"
    if s < 1:
        return f"{fmt_num(s * 1e3)} ms"
    return f"{fmt_num(s)} s"


def fmt_value(value: Optional[float], unit: str) -> str:
    if unit == "s":
        return fmt_seconds(value)
    return fmt_num(value)


def fmt_speedup(x: Optional[float]) -> str:
    if x is None or math.isnan(x):
        return "-"
    return f"{x:.2f}x" if x < 100 else f"{x:,.0f}x"


class Table:
    """An aligned plain-text table: text columns left-aligned, the others right-aligned."""

    def __init__(self, headers: Sequence[str], align: Optional[str] = None):
        self.headers = list(headers)
        self.align = align or "l" + "r" * (len(headers) - 1)
        if len(self.align) != len(self.headers):
            raise ValueError("one alignment letter (l or r) per column")
        self.rows: List[Optional[List[str]]] = []

    def add(self, *cells: Any) -> None:
        if len(cells) != len(self.headers):
            raise ValueError(f"{len(cells)} cells for {len(self.headers)} columns")
        self.rows.append(["" if c is None else str(c) for c in cells])

    def separator(self) -> None:
        self.rows.append(None)

    def render(self) -> str:
        widths = [len(h) for h in self.headers]
        for row in self.rows:
            if row is not None:
                widths = [max(w, len(c)) for w, c in zip(widths, row)]

        def line(cells: Sequence[str]) -> str:
            parts = [c.ljust(w) if a == "l" else c.rjust(w) for c, w, a in zip(cells, widths, self.align)]
            return "  ".join(parts).rstrip()

        rule = "  ".join("-" * w for w in widths)
        out = [line(self.headers), rule]
        for row in self.rows:
            out.append(rule if row is None else line(row))
        return "\n".join(out)


# -- environment and JSON ------------------------------------------------------------------------


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for text in fh:
                if text.startswith("model name"):
                    return text.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def environment(extra: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Where a benchmark ran: enough to tell whether two results are comparable."""
    try:
        affinity = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        affinity = None
    env: Dict[str, Any] = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "nproc": os.cpu_count(),
        "cpu_affinity": affinity,
        "cpu_model": cpu_model(),
        "argv": sys.argv,
    }
    try:
        from distlib import __version__

        env["distlib"] = __version__
    except ImportError:  # pragma: no cover
        env["distlib"] = None
    torch = sys.modules.get("torch")
    env["torch"] = getattr(torch, "__version__", None) if torch else None
    if extra:
        env.update(extra)
    return env


def implementations(no_torch: bool) -> Tuple[List[str], Optional[str], str]:
    """What a run measures: ([distlib] or [distlib, torch], torch's version, and why torch is
    not measured, "" when it is). torch is imported here, once, in the parent, so that every
    forked child has it already (torch takes seconds to import)."""
    if no_torch:
        return [DISTLIB], None, "--no-torch"
    try:
        import torch.distributed  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means: no torch here
        return [DISTLIB], None, "not importable"
    return [DISTLIB, TORCH], sys.modules["torch"].__version__, ""


def interleaved(rounds: int, impls: Sequence[str]) -> List[Tuple[int, str]]:
    """(round, impl) pairs in the order they should run: a, b, a, b, ..."""
    return [(r, impl) for r in range(rounds) for impl in impls]


class Printer:
    """Progress lines go to stderr (or nowhere with quiet), results to stdout, so that
    ``--json -`` leaves stdout to the JSON."""

    def __init__(self, quiet: bool = False, stream: Optional[io.TextIOBase] = None):
        self.quiet = quiet
        self.stream = stream or sys.stderr

    def __call__(self, text: str) -> None:
        if not self.quiet:
            print(text, file=self.stream, flush=True)
