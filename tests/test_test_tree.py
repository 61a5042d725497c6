"""The test tree's own rules: no test module imports another (what two test modules share lives
in a module that is not a test: tests/support, or a helper beside them), and every test carries
its lane's marker (tests/support/lanes.py), registered in pyproject.toml and left out of
`make test-unit` where the lane needs Docker or VMs."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Dict, List

import pytest

from tests.support.lanes import FIXTURE_LANES, LANES, misplaced, unit_selection

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def imported_modules(path: Path, source: str) -> List[tuple]:
    """(line, module) for every module ``source`` (the file at ``path``) imports, relative
    imports resolved, ``from package import name`` also as ``package.name``."""
    package = module_name(path).split(".")[:-1]
    found = []
    for node in ast.walk(ast.parse(source, str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            found.append((node.lineno, target))
            found += [(node.lineno, f"{target}.{alias.name}") for alias in node.names]
    return found


def imports_of_test_modules(test_modules: Dict[str, Path]) -> List[str]:
    """'path:line imports module' for each import of a test module by another module of tests/."""
    found = []
    for path in sorted(TESTS.rglob("*.py")):
        for line, module in imported_modules(path, path.read_text()):
            if module in test_modules and test_modules[module] != path:
                found.append(f"{path.relative_to(ROOT)}:{line} imports the test module {module}")
    return found


def all_test_modules() -> Dict[str, Path]:
    return {module_name(p): p for p in TESTS.rglob("test_*.py")}


def test_the_scan_sees_every_form_of_import(tmp_path):
    package = TESTS / "collectives"
    lines = ["from tests.collectives.test_errors import X", "import tests.collectives.test_errors",
             "from .test_errors import X", "from . import test_errors", "from tests.collectives import test_errors",
             "from ..collectives.test_errors import X", "def f():\n    from .test_errors import X",
             "from . import cases", "from tests.support import compose"]
    hits = [module for line in lines
            for _, module in imported_modules(package / "probe.py", line) if module in all_test_modules()]
    assert hits == ["tests.collectives.test_errors"] * 7, hits


def test_no_module_of_the_test_tree_imports_a_test_module():
    found = imports_of_test_modules(all_test_modules())
    assert not found, ("move what they share out of the test module (tests/support, or a helper module "
                       "beside it):\n" + "\n".join(found))


# -- one marker per lane ---------------------------------------------------------------------------


@pytest.mark.parametrize("fixtures, markers, problem", [
    (["tmp_path"], [], None),
    (["docker_client", "distlib_image"], ["containers"], None),
    (["docker_client", "kube"], ["kube", "timeout"], None),
    (["docker_client", "vm_image", "nfs_hosts"], ["vms"], None),
    ([], ["gpu"], None),  # a lane without a fixture: the marker alone says it
    (["docker_client", "kube"], ["containers"],
     "t uses the fixture kube, which needs the kube lane, but it is marked containers: mark it @pytest.mark.kube"),
    (["docker_client", "kube"], [], "t uses the fixture kube, which needs the kube lane, but it carries no lane marker"),
    (["distlib_image", "docker_client"], [], "t uses the fixture docker_client, which needs the containers lane"),
    (["docker_client", "vm_image"], ["containers", "vms"], "t carries the markers of 2 lanes (containers, vms)"),
    (["docker_client"], ["kube"], "t uses the fixture docker_client, which needs the containers lane, but it is "
                                  "marked kube"),
    (["kube", "slurm_image"], ["kube"], "t uses fixtures of 2 lanes (kube: kube, slurm_image: slurm)"),
])
def test_a_test_is_held_to_its_lane(fixtures, markers, problem):
    got = misplaced("t", fixtures, markers)
    if problem is None:
        assert got is None, got
    else:
        assert got is not None and got.startswith(problem), got


def fixture_names(paths) -> set:
    """The names of the functions decorated with ``pytest.fixture`` (called or not) in ``paths``."""
    names = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for dec in node.decorator_list:
                    target = dec.func if isinstance(dec, ast.Call) else dec
                    if isinstance(target, ast.Attribute) and target.attr == "fixture":
                        names.add(node.name)
    return names


def test_each_lane_fixture_is_still_a_fixture():
    """A renamed fixture would leave its tests unchecked: the table follows the fixtures."""
    defined = fixture_names([*TESTS.rglob("*.py"), *(ROOT / "distlib").rglob("*.py")])
    missing = sorted(name for name in FIXTURE_LANES if name not in defined)
    assert not missing, f"tests/support/lanes.py names fixtures that no longer exist: {missing}"


def test_a_test_outside_its_lane_stops_the_session_naming_it(pytester):
    """The collection-time check, end to end: the wrong marker is named, whatever -m selects."""
    pytester.makeconftest("""
import pytest
pytest_plugins = ["tests.support.lanes"]

@pytest.fixture
def docker_client():
    return object()

@pytest.fixture
def kube(docker_client):
    return object()
""")
    pytester.makepyfile(test_lane="""
import pytest

@pytest.mark.containers
def test_uses_the_cluster(kube):
    pass

def test_plain():
    pass
""")
    result = pytester.runpytest("-m", "not containers", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR, result.stdout.str() + result.stderr.str()
    result.stderr.fnmatch_lines(["*test_lane.py::test_uses_the_cluster uses the fixture kube, which needs the kube "
                                 "lane, but it is marked containers: mark it @pytest.mark.kube*"])


def test_every_lane_is_registered_with_what_it_needs():
    text = (ROOT / "pyproject.toml").read_text()
    registered = dict(re.findall(r'^\s*"(\w+): ([^"]*)",$', text[text.index("markers = ["):], re.M))
    assert {name: registered.get(name) for name in LANES} == {name: lane.needs for name, lane in LANES.items()}


def test_make_test_unit_leaves_out_every_lane_that_needs_docker_or_vms():
    makefile = (ROOT / "Makefile").read_text()
    recipe = re.search(r"^test-unit:.*\n\t(.*)$", makefile, re.M).group(1)
    assert f'-m "{unit_selection()}"' in recipe, recipe
    assert unit_selection() == "not containers and not vms and not kube and not slurm"
    readme = (ROOT / "README.md").read_text()
    assert f'`-m "{unit_selection()}"' in readme, "README's `make test-unit` sentence names another selection"
