"""No module of distlib/ (nor of deploy/ and bench/) is over MAX_LINES lines: small modules with one job each, which a
reader can hold in mind (docs/architecture.md). A module that grows past the limit is split
along its jobs, not given an exception.

``OVER_SIZE`` is the list of modules over the limit today, each with the branch that is
splitting it. It only shrinks: the lead removes an entry when that branch has landed, and the
second test fails for an entry that is no longer over the limit (remove it) or gone.
"""

from pathlib import Path
from typing import Dict

MAX_LINES = 600
ROOT = Path(__file__).resolve().parent.parent
#: The repository's three packages.
PACKAGES = (ROOT / "distlib", ROOT / "deploy" / "distlib_deploy", ROOT / "bench" / "distlib_bench")

#: Modules over MAX_LINES, and the branch splitting each (issue 26). Empty it; never add to it.
OVER_SIZE: Dict[str, str] = {}


def module_lines() -> Dict[str, int]:
    """Lines of every module of the three packages, by path relative to the repository."""
    return {path.relative_to(ROOT).as_posix(): len(path.read_text(encoding="utf-8").splitlines())
            for package in PACKAGES for path in sorted(package.rglob("*.py"))}


def test_no_module_is_over_the_limit():
    over = {path: n for path, n in module_lines().items() if n > MAX_LINES and path not in OVER_SIZE}
    assert over == {}, (f"modules over {MAX_LINES} lines: {over}; split each along its jobs "
                        "(docs/architecture.md), and place the new modules in tests/test_layers.py")


def test_the_allow_list_names_only_modules_still_over_the_limit():
    lines = module_lines()
    stale = {path: lines.get(path) for path in OVER_SIZE if lines.get(path, 0) <= MAX_LINES}
    assert stale == {}, (f"these modules are gone or within {MAX_LINES} lines now (lines: {stale}): "
                         "remove them from OVER_SIZE")


def test_the_check_counts_what_it_should():
    lines = module_lines()
    assert "distlib/store/tcp/codec.py" in lines and "bench/distlib_bench/store.py" in lines
    assert "deploy/distlib_deploy/cluster/commands.py" in lines
    init = ROOT / "distlib" / "__init__.py"
    assert lines["distlib/__init__.py"] == len(init.read_text(encoding="utf-8").splitlines())
