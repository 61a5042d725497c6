"""No module of distlib/ is over MAX_LINES lines: small modules with one job each, which a
reader can hold in mind (docs/architecture.md). A module that grows past the limit is split
along its jobs, not given an exception.

``OVER_SIZE`` is the list of modules over the limit today, each with the branch that is
splitting it. It only shrinks: the lead removes an entry when that branch has landed, and the
second test fails for an entry that is no longer over the limit (remove it) or gone.
"""

from pathlib import Path
from typing import Dict

import distlib

MAX_LINES = 600
PACKAGE = Path(distlib.__file__).parent

#: Modules over MAX_LINES, and the branch splitting each (issue 26). Empty it; never add to it.
OVER_SIZE: Dict[str, str] = {}


def module_lines() -> Dict[str, int]:
    """Lines of every module of the package, by path relative to distlib/."""
    return {str(path.relative_to(PACKAGE)): len(path.read_text(encoding="utf-8").splitlines())
            for path in sorted(PACKAGE.rglob("*.py"))}


def test_no_module_is_over_the_limit():
    over = {path: n for path, n in module_lines().items() if n > MAX_LINES and path not in OVER_SIZE}
    assert over == {}, (f"modules of distlib/ over {MAX_LINES} lines: {over}; split each along its jobs "
                        "(docs/architecture.md), and place the new modules in tests/test_layers.py")


def test_the_allow_list_names_only_modules_still_over_the_limit():
    lines = module_lines()
    stale = {path: lines.get(path) for path in OVER_SIZE if lines.get(path, 0) <= MAX_LINES}
    assert stale == {}, (f"these modules are gone or within {MAX_LINES} lines now (lines: {stale}): "
                         "remove them from OVER_SIZE")


def test_the_check_counts_what_it_should():
    lines = module_lines()
    assert "store/tcp/codec.py" in lines and "tools/bench/store.py" in lines
    assert lines["__init__.py"] == len((PACKAGE / "__init__.py").read_text(encoding="utf-8").splitlines())
