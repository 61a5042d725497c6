"""The tools stay out of the library: no module of the library imports distlib.tools, and the
`distlib` command (distlib/cli.py) reaches them only inside the functions that run a tool."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "distlib"


def tools_imports(source: str, package: str):
    """(line, at module level?) of every import of distlib.tools in ``source``, a module of
    ``package`` (for relative imports)."""
    tree = ast.parse(source)
    top_level = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            names = [base] + [f"{base}.{alias.name}" for alias in node.names]
        if any(n == "distlib.tools" or n.startswith("distlib.tools.") for n in names):
            found.append((node.lineno, id(node) in top_level))
    return found


def test_the_scan_sees_each_way_of_importing():
    sample = ("import distlib.tools.demo\nfrom ..tools import command\nfrom distlib import tools\n"
              "from . import shm\ndef f():\n    from .. import tools\n")
    assert tools_imports(sample, "distlib.transport") == [(1, True), (2, True), (3, True), (6, False)]


def test_no_library_module_imports_the_tools():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        if rel.parts[0] == "tools":
            continue
        package = ".".join(("distlib",) + rel.parts[:-1])
        for line, at_top in tools_imports(path.read_text(), package):
            if rel.as_posix() == "cli.py" and not at_top:
                continue  # the command hands a subcommand to its tool when it runs
            offenders.append(f"distlib/{rel.as_posix()}:{line}")
    assert not offenders, "the library must not import distlib.tools:\n" + "\n".join(offenders)


def test_importing_the_library_and_its_command_loads_no_tool():
    code = ("import sys, distlib, distlib.cli, distlib.run; distlib.cli.build_parser(); "
            "print(sorted(m for m in sys.modules if m.startswith('distlib.tools')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_the_scaffold_does_not_import_numpy():
    code = ("import sys; from distlib.tools import command; command.parse_endpoint('m:1'); "
            "print('numpy' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stdout + out.stderr
