"""Rows, targets and results: what a benchmark reports and what it must reach.

* A ``Row`` holds one figure per implementation per round. Its ``speedup`` is always "how
  many times better distlib is than the reference" (ops/s: distlib / torch; times: torch /
  distlib), so > 1 means distlib is ahead whatever the unit.
* A ``Target`` is either a minimum speed-up over the reference or an absolute bound on
  distlib's figure; ``Row.result`` says PASS, MISS or n/a (not measurable in this run). The
  targets themselves are data, ``targets.json`` beside this module (``load_targets``): what a
  benchmark must reach is decided by whoever asks for it, not by the code that measures.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .children import BenchError
from .timing import json_number, median, spread

DISTLIB, TORCH = "distlib", "torch"


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
            entry: Dict[str, Any] = {"median": json_number(self.median(impl)) if vals else None,
                                     "rounds": [json_number(v) for v in vals or []],
                                     "spread": json_number(spread(vals or [])),
                                     "details": self.details.get(impl, [])}
            if impl in self.errors:
                entry["error"] = self.errors[impl]
            out[impl] = entry
        out["speedup"] = json_number(self.speedup(impls[0], reference)) if reference in impls else None
        out["target"] = self.target.to_json() if self.target else None
        out["result"] = self.result(impls[0], reference) or None
        if self.note:
            out["note"] = self.note
        return out


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
