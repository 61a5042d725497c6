"""Fixtures of the container tests beyond tests/fixtures/docker.py: named volumes, a state
directory for the cluster driver, and the Slurm cluster (tests/support/slurm.py)."""

from __future__ import annotations

import pytest

from tests.containers._ranks import named_volumes
from tests.support.compose import run_cluster
from tests.support.slurm import slurm_cluster, slurm_image  # noqa: F401 - fixtures of the Slurm tests


@pytest.fixture
def named_volume(docker_client):
    """Factory: ``named_volume(hint)`` → a new labelled docker-py Volume, removed after the test
    (with any container still using it)."""
    with named_volumes(docker_client) as make:
        yield make


@pytest.fixture
def cluster_state(tmp_path, docker_client):
    """A state directory for the cluster driver; whatever a failed test left is removed after it."""
    state_dir = tmp_path / "cluster-state"
    yield state_dir
    if state_dir.exists():
        run_cluster("down", state_dir, timeout=120)
