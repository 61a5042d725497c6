"""The test lanes: one marker each, what each stands on, and the collection-time check that holds
every test to its lane, so that `pytest -m kube` runs every test that needs the kubelet and
`make test-unit` (every lane that needs Docker or VMs left out) runs none of them.

A test's lane follows from its fixtures (``FIXTURE_LANES``, through the whole fixture closure:
``kube`` needs ``docker_client`` too, and its lane is ``kube``). A test that needs a lane must
carry exactly that lane's marker; no test carries two. A test whose fixtures need no lane may
still carry one (a test that drives a platform without a fixture). Loaded as a plugin by
tests/conftest.py; a wrong marker stops the session at collection, naming the test, the fixture
and the marker it needs, whatever ``-m`` selects.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, List, Mapping, Optional, Sequence

import pytest

from tests.support import settings


@dataclass(frozen=True)
class Lane:
    marker: str
    #: what the lane stands on (pyproject.toml registers the marker with this text)
    needs: str
    #: it needs a Docker engine or VMs: `make test-unit` leaves it out, and without the engine it
    #: skips, or fails under DISTLIB_REQUIRE_DOCKER=1 (CI)
    platform: bool


LANES: Mapping[str, Lane] = {lane.marker: lane for lane in (
    Lane("containers", "a Docker engine: real containers (the images, the Compose cluster, testcontainers)", True),
    Lane("vms", "QEMU VMs with real NFS clients and servers (tests/platforms), and the Docker engine", True),
    Lane("kube", "a real Kubernetes 1.20 control plane and kubelet on this machine (tests/helm), and the Docker "
                 "engine", True),
    Lane("slurm", "a Slurm 22.05 cluster in containers (the Docker engine)", True),
    Lane("interop", "torch importable (run by `make test-interop`)", False),
    Lane("gpu", "a CUDA GPU and cupy (run by `make test-gpu`)", False),
)}

#: The fixtures that stand a lane up. Only the roots: every fixture built on one (distlib_image
#: on docker_client, nfs_hosts on vm_image, slurm_cluster on slurm_image) is in a test's closure
#: with its root. tests/test_test_tree.py checks that each name is still a fixture.
FIXTURE_LANES: Mapping[str, str] = {
    "docker_client": "containers",
    "vm_image": "vms",
    "kube": "kube",
    "slurm_image": "slurm",
}

#: The lane every other platform lane stands on: needing it is no reason for another marker.
BASE = "containers"


def unit_selection() -> str:
    """The ``-m`` expression of `make test-unit`: every platform lane left out."""
    return " and ".join(f"not {name}" for name, lane in LANES.items() if lane.platform)


def unavailable(reason: str, lane: str) -> None:
    """A platform a lane needs is missing: skip the test, or under DISTLIB_REQUIRE_DOCKER=1 (CI)
    fail it, saying which lane could not run."""
    if settings.require_docker():
        pytest.fail(f"{reason} (DISTLIB_REQUIRE_DOCKER=1: the {lane} lane must run)", pytrace=False)
    pytest.skip(reason)


def misplaced(test: str, fixtures: Iterable[str], markers: Iterable[str]) -> Optional[str]:
    """Why ``test`` (using ``fixtures``, marked ``markers``) is not in its lane, or None."""
    marked = sorted({m for m in markers if m in LANES})
    if len(marked) > 1:
        return f"{test} carries the markers of {len(marked)} lanes ({', '.join(marked)}): one lane per test"
    needs = {}
    for fixture in fixtures:
        if fixture in FIXTURE_LANES:
            needs.setdefault(FIXTURE_LANES[fixture], fixture)
    if not needs:
        return None
    specific = sorted(lane for lane in needs if lane != BASE)
    if len(specific) > 1:
        return (f"{test} uses fixtures of {len(specific)} lanes ("
                + ", ".join(f"{needs[lane]}: {lane}" for lane in specific) + "): one lane per test")
    lane = specific[0] if specific else BASE
    if marked == [lane]:
        return None
    now = f"it is marked {marked[0]}" if marked else "it carries no lane marker"
    return (f"{test} uses the fixture {needs[lane]}, which needs the {lane} lane, but {now}: "
            f"mark it @pytest.mark.{lane} (or pytestmark = pytest.mark.{lane})")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: Sequence[pytest.Item]) -> None:
    """Before ``-m``/``-k`` deselect anything: every collected test in its lane."""
    problems: List[str] = []
    for item in items:
        fixtures = getattr(item, "fixturenames", ())
        problem = misplaced(item.nodeid, fixtures, (m.name for m in item.iter_markers()))
        if problem:
            problems.append(problem)
    if problems:
        raise pytest.UsageError("tests outside their lane (tests/support/lanes.py):\n  " + "\n  ".join(problems))
