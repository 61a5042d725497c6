"""distlib/settings.py: one rule for flags, one table of variables, one module that reads them."""

import ast
import re
from pathlib import Path

import pytest

from distlib import settings

ROOT = Path(__file__).resolve().parent.parent
TABLE = ROOT / "docs" / "settings.md"


@pytest.mark.parametrize("value", ["1", "true", "YES", " on ", "True"])
def test_every_yes_spelling_is_yes(value):
    assert settings.flag("DISTLIB_X", False, {"DISTLIB_X": value}) is True


@pytest.mark.parametrize("value", ["0", "false", "No", "OFF "])
def test_every_no_spelling_is_no(value):
    assert settings.flag("DISTLIB_X", True, {"DISTLIB_X": value}) is False


@pytest.mark.parametrize("env", [{}, {"DISTLIB_X": ""}, {"DISTLIB_X": "  "}])
def test_unset_or_empty_is_the_default(env):
    assert settings.flag("DISTLIB_X", True, env) is True
    assert settings.flag("DISTLIB_X", False, env) is False


def test_a_flag_that_is_neither_names_the_variable():
    with pytest.raises(ValueError, match=r"DISTLIB_SHM='2' is not a yes/no flag"):
        settings.shared_memory({"DISTLIB_SHM": "2"})


def test_values_are_read_when_asked_not_at_import(monkeypatch):
    monkeypatch.setenv("DISTLIB_SHM", "0")
    assert settings.shared_memory() is False
    monkeypatch.setenv("DISTLIB_SHM", "1")
    assert settings.shared_memory() is True


def test_torch_agent_store_variable_keeps_torchs_exact_rule():
    assert settings.external_store({"TORCHELASTIC_USE_AGENT_STORE": "True"}) is True
    assert settings.external_store({"TORCHELASTIC_USE_AGENT_STORE": "true"}) is False  # torch ignores it too
    assert settings.external_store({"DISTLIB_EXTERNAL_STORE": "yes"}) is True


def test_run_id_worker_and_launcher_precedence():
    both = {"TORCHELASTIC_RUN_ID": "t", "DISTLIB_RUN_ID": "d"}
    assert settings.run_id(both) == "t"
    assert settings.launcher_run_id(both) == ("DISTLIB_RUN_ID", "d")
    assert settings.launcher_run_id({"TORCHELASTIC_RUN_ID": "t"}) == ("TORCHELASTIC_RUN_ID", "t")
    assert settings.launcher_run_id({}) is None


@pytest.mark.parametrize("value, expected", [("", None), ("30000-30100", (30000, 30100)), ("7-7", (7, 7))])
def test_port_range(value, expected):
    assert settings.port_range({"DISTLIB_PORT_RANGE": value}) == expected


@pytest.mark.parametrize("value", ["30000", "a-b", "200-100", "0-10", "1-70000"])
def test_a_bad_port_range_is_an_error_naming_the_variable(value):
    with pytest.raises(ValueError, match="DISTLIB_PORT_RANGE"):
        settings.port_range({"DISTLIB_PORT_RANGE": value})


#: Each package's settings module and the heading of its table in docs/settings.md.
READERS = {
    "distlib/settings.py": "## The library",
    "deploy/distlib_deploy/settings.py": "## The deployment",
    "tests/support/settings.py": "## The test suite",
    "distlib/testing/settings.py": "## The testing harness",
}


def _read_in(module: str):
    return set(re.findall(r'"(DISTLIB_[A-Z0-9_]+)"', (ROOT / module).read_text()))


def _documented(heading: str):
    """The variables of the table under ``heading`` (up to the next heading)."""
    text = TABLE.read_text()
    section = text[text.index(heading):]
    following = section.find("\n## ", 1)
    section = section if following < 0 else section[:following]
    rows = [line for line in section.splitlines() if line.startswith("| `DISTLIB_")]
    return {re.match(r"\| `(DISTLIB_[A-Z0-9_]+)`", row).group(1) for row in rows}


@pytest.mark.parametrize("module", sorted(READERS))
def test_each_table_names_exactly_the_variables_its_module_reads(module):
    assert _read_in(module) == _documented(READERS[module])


def _environment_reads(path: Path):
    """(line, variable) for each read of a DISTLIB_* variable from a process environment in
    ``path`` (``os.environ`` or a mapping named ``environ``): get, getenv, [...] loads and
    ``in`` tests. Dicts of environments a test inspects (a rendered manifest's) are not reads."""
    tree = ast.parse(path.read_text(), str(path))
    found = []

    def literal(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("DISTLIB_"):
            return node.value
        return None

    def is_environ(node):
        return (isinstance(node, ast.Attribute) and node.attr == "environ") or \
               (isinstance(node, ast.Name) and node.id == "environ")

    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args:
            func = node.func
            name = literal(node.args[0])
            if name and isinstance(func, ast.Attribute) and (
                    (func.attr in ("get", "pop") and is_environ(func.value)) or func.attr == "getenv"):
                if not (func.attr == "pop"):
                    found.append((node.lineno, name))
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and is_environ(node.value):
            name = literal(node.slice)
            if name:
                found.append((node.lineno, name))
        elif isinstance(node, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops):
            name = literal(node.left)
            if name and any(is_environ(c) for c in node.comparators):
                found.append((node.lineno, name))
    return found


def test_no_other_module_reads_a_distlib_variable():
    offenders = []
    trees = ("distlib", "deploy", "bench", "tests")
    for path in sorted(p for tree in trees for p in (ROOT / tree).rglob("*.py")):
        if path.relative_to(ROOT).as_posix() in READERS:
            continue
        offenders += [f"{path.relative_to(ROOT)}:{line}: {name}" for line, name in _environment_reads(path)]
    assert not offenders, "read these through their package's settings module:\n" + "\n".join(offenders)


def test_the_scan_finds_reads(tmp_path):
    """The scan above must see each way of reading, or its silence means nothing."""
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import os\n"
        "a = os.environ.get('DISTLIB_A')\n"
        "b = os.getenv('DISTLIB_B', '1')\n"
        "c = os.environ['DISTLIB_C']\n"
        "d = 'DISTLIB_D' in os.environ\n"
        "def f(environ):\n    return environ.get('DISTLIB_E')\n"
        "os.environ['DISTLIB_W'] = '1'\n")
    assert [name for _, name in _environment_reads(sample)] == [
        "DISTLIB_A", "DISTLIB_B", "DISTLIB_C", "DISTLIB_D", "DISTLIB_E"]


def test_the_store_reconnect_timeout_is_read_and_bad_values_name_the_variable():
    assert settings.store_reconnect_timeout({}) is None
    assert settings.store_reconnect_timeout({"DISTLIB_STORE_RECONNECT_TIMEOUT": "0"}) == 0.0
    assert settings.store_reconnect_timeout({"DISTLIB_STORE_RECONNECT_TIMEOUT": "2.5"}) == 2.5
    for bad in ("-1", "soon", "nan"):
        with pytest.raises(ValueError, match="DISTLIB_STORE_RECONNECT_TIMEOUT="):
            settings.store_reconnect_timeout({"DISTLIB_STORE_RECONNECT_TIMEOUT": bad})
