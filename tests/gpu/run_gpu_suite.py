"""``make test-gpu``: the GPU tests and the GPU benchmark in one go, within five minutes on one
GPU, from a plain copy of the tree (``PYTHONPATH=.:deploy:bench python3 -m tests.gpu.run_gpu_suite``: no
virtual environment, no pip, no Docker; the machine's python3 needs numpy, cupy with NCCL and
pytest, and torch for the comparison). Where there is no usable GPU it says why in one line
and runs nothing (exit 2).

1. ``pytest tests/gpu -m gpu`` (in 4 workers when pytest-xdist is there), its report in
   ``$GPU_OUT/tests.xml`` (default ``gpu-results/``);
2. ``distlib bench collectives --device cuda --ops all_reduce -b 8 -e 256M`` at one rank and
   at two ranks sharing GPU 0 (each its own NCCL_HOSTID), with torch's nccl beside it when
   torch sees the GPU: the sweep, and at one rank the per-call rows (3,000 back to back, 10
   and 10,000 in flight); JSON in ``$GPU_OUT/bench-ws{1,2}.json``;
3. a summary: tests passed / failed / skipped (and which failed), and each target's figures,
   ratio and result. Exit 0 only when no test failed and the benchmark ran without failures
   (a missed target is reported, not a failure: it is a measurement).

Extra arguments go to pytest (``make test-gpu PYTEST_ARGS='-k silent'``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import List, Optional

BUDGET_S = 300.0
#: The tests' share of the budget; the benchmark gets the rest.
TESTS_S = 190.0
BENCH_SIZES = ["-b", "8", "-e", "256M", "-f", "4"]


def _missing() -> Optional[str]:
    """Why this machine cannot run the GPU suite, or None."""
    for module in ("numpy", "pytest"):
        if importlib.util.find_spec(module) is None:
            return f"{module} is not importable by {sys.executable}"
    from distlib.backends import cupy_env

    status = cupy_env.status()
    return None if status.usable else status.problem


def _run(cmd: List[str], seconds: float, what: str) -> str:
    """Run ``cmd`` (its output goes to ours); "" or what went wrong."""
    print(f"\n== {what}: {' '.join(cmd)}", flush=True)
    if seconds <= 5:
        return f"{what}: not run, the {BUDGET_S:.0f} s budget was spent"
    try:
        done = subprocess.run(cmd, timeout=seconds)
    except subprocess.TimeoutExpired:
        return f"{what}: stopped after {seconds:.0f} s (the budget)"
    return "" if done.returncode == 0 else f"{what}: exit status {done.returncode}"


def _tests_summary(path: Path) -> List[str]:
    if not path.exists():
        return ["tests: no report (pytest did not finish)"]
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    count = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    failed = [f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
              for case in root.iter("testcase") if case.find("failure") is not None or case.find("error") is not None]
    passed = count["tests"] - count["failures"] - count["errors"] - count["skipped"]
    lines = [f"tests: {passed} passed, {count['failures'] + count['errors']} failed, {count['skipped']} skipped"]
    lines += [f"  FAILED {name}" for name in failed]
    return lines


def _bench_summary(path: Path, label: str) -> List[str]:
    if not path.exists():
        return [f"bench {label}: no JSON (it did not finish)"]
    doc = json.loads(path.read_text())
    lines = [f"bench {label}: {doc['environment'].get('gpus', ['?'])[0] if doc['environment'].get('gpus') else '?'}"]
    for target in doc.get("targets", []):
        ours, theirs = target.get("distlib") or {}, target.get("torch") or {}
        fig = lambda entry: "-" if entry.get("median") is None else f"{entry['median'] * 1e6:.1f} us"  # noqa: E731
        ratio = target.get("speedup")
        lines.append(f"  {target['label']}: distlib {fig(ours)}, torch {fig(theirs)}, ratio "
                     f"{'-' if ratio is None else f'{ratio:.2f}x'} ({target['target']['text']}) -> "
                     f"{target.get('result') or 'n/a'}{': ' + target['note'] if target.get('note') else ''}")
    lines += [f"  FAILED {failure.splitlines()[0]}" for failure in doc.get("failures", [])]
    return lines


def main(argv: List[str]) -> int:
    started = time.monotonic()
    why = _missing()
    if why:
        print(f"make test-gpu needs a CUDA GPU with cupy and NCCL (and pytest): here {why}. Nothing was run.",
              file=sys.stderr)
        return 2
    out = Path(os.environ.get("GPU_OUT", "gpu-results"))
    out.mkdir(parents=True, exist_ok=True)
    problems = []
    workers = ["-n", "4"] if importlib.util.find_spec("xdist") is not None else []
    problems.append(_run([sys.executable, "-m", "pytest", "tests/gpu", "-m", "gpu", "-p", "no:cacheprovider", "-q",
                          "-rfE", f"--junitxml={out / 'tests.xml'}", *workers, *argv], TESTS_S, "GPU tests"))
    for nproc in (1, 2):
        left = BUDGET_S - (time.monotonic() - started)
        json_path = out / f"bench-ws{nproc}.json"
        json_path.unlink(missing_ok=True)
        problems.append(_run([sys.executable, "-m", "distlib_bench", "collectives", "--device", "cuda", "--ops",
                              "all_reduce", *BENCH_SIZES, "--iters", "10", "--warmup", "3", "--rounds", "3",
                              "--nproc", str(nproc), "--json", str(json_path)],
                             left / (3 - nproc), f"GPU benchmark, {nproc} rank(s)"))
    print(f"\n== make test-gpu summary ({time.monotonic() - started:.0f} s; results in {out}/)")
    for line in _tests_summary(out / "tests.xml") + _bench_summary(out / "bench-ws1.json", "1 rank") + \
            _bench_summary(out / "bench-ws2.json", "2 ranks on one GPU"):
        print(line)
    problems = [p for p in problems if p]
    for problem in problems:
        print(f"PROBLEM {problem}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
