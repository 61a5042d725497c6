"""How the benchmarks print: numbers and durations, the aligned table, progress lines, and
the environment a run records (enough to tell whether two results are comparable).

Progress lines go to stderr (``Printer``), results to stdout, so that ``--json -`` leaves
stdout to the JSON.
"""

from __future__ import annotations

import datetime
import io
import math
import os
import platform
import sys
from typing import Any, Dict, List, Optional, Sequence


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
                widths = [max(w, len(c)) for w, c in zip(widths, row, strict=True)]

        def line(cells: Sequence[str]) -> str:
            parts = [c.ljust(w) if a == "l" else c.rjust(w) for c, w, a in zip(cells, widths, self.align, strict=True)]
            return "  ".join(parts).rstrip()

        rule = "  ".join("-" * w for w in widths)
        out = [line(self.headers), rule]
        for row in self.rows:
            out.append(rule if row is None else line(row))
        return "\n".join(out)


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


def print_block(out, text: Optional[str], lines: Optional[Sequence[str]] = None) -> None:
    """One part of a report, set apart by a blank line: ``text``, then ``lines`` if given;
    nothing when there is no text, or no lines where lines are asked for."""
    if not text or (lines is not None and not lines):
        return
    print(file=out)
    print(text, file=out)
    if lines:
        print("\n".join(lines), file=out)


class Printer:
    """Progress lines go to stderr (or nowhere with quiet), results to stdout, so that
    ``--json -`` leaves stdout to the JSON."""

    def __init__(self, quiet: bool = False, stream: Optional[io.TextIOBase] = None):
        self.quiet = quiet
        self.stream = stream or sys.stderr

    def __call__(self, text: str) -> None:
        if not self.quiet:
            print(text, file=self.stream, flush=True)
