"""The library stands alone: no module of distlib imports the deployment (distlib_deploy) or
the benchmarks (distlib_bench), importing the library and its command loads neither, and the
``distlib`` command finds their subcommands only through the entry-point group."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.support.import_graph import PACKAGES, import_graph

ROOT = Path(__file__).resolve().parents[2]
OUTSIDE = ("distlib_deploy", "distlib_bench")


def outside_imports(graph) -> list:
    """Library modules that import a module of the other two packages."""
    return sorted(f"{m} imports {t}" for m, targets in graph.items() if m.split(".")[0] == "distlib"
                  for t in targets if t.split(".")[0] in OUTSIDE)


def test_the_scan_sees_a_library_module_importing_the_deployment():
    assert outside_imports({"distlib.cli": {"distlib_deploy.demo"}, "distlib_bench.store": {"distlib.store"}}) == [
        "distlib.cli imports distlib_deploy.demo"]


def test_no_library_module_imports_the_deployment_or_the_benchmarks():
    assert outside_imports(import_graph(PACKAGES)) == []


def test_importing_the_library_and_its_command_loads_neither_package():
    code = ("import sys, distlib, distlib.cli, distlib.run; distlib.cli.build_parser(); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('distlib_deploy', 'distlib_bench')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_the_command_finds_the_other_packages_subcommands_by_entry_point():
    from distlib import cli

    found = cli.installed_commands()
    assert {name: found[name].value for name in ("bench", "cluster", "demo")} == {
        "bench": "distlib_bench:main", "cluster": "distlib_deploy.cluster:main", "demo": "distlib_deploy.demo:main"}


def test_a_subcommand_whose_package_is_missing_names_the_package(monkeypatch, capsys):
    from distlib import cli

    monkeypatch.setattr(cli, "installed_commands", lambda: {})
    assert cli.main(["bench", "store"]) == 2
    assert "distlib bench: not installed here: it is in the package distlib-c10d-bench" in capsys.readouterr().err


def test_the_scaffold_does_not_import_numpy():
    code = ("import sys; from distlib import command; command.parse_endpoint('m:1'); "
            "print('numpy' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stdout + out.stderr
