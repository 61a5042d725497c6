"""Fixtures of the container tests beyond tests/fixtures/docker.py: the harness's clusters of
containers, a state directory for the cluster driver, and the Slurm cluster (tests/support/slurm.py)."""

from __future__ import annotations

import pytest

from tests.support.compose import run_cluster
from tests.support.slurm import slurm_cluster, slurm_image  # noqa: F401 - fixtures of the Slurm tests


@pytest.fixture
def containers(distlib_cluster, distlib_image):
    """``containers(nodes)``: a distlib.testing cluster of containers of the session's image."""

    def make(nodes: int, **options):
        return distlib_cluster(nodes=nodes, substrate="containers", image=distlib_image, **options)

    return make


@pytest.fixture
def cluster_state(tmp_path, docker_client):
    """A state directory for the cluster driver; whatever a failed test left is removed after it."""
    state_dir = tmp_path / "cluster-state"
    yield state_dir
    if state_dir.exists():
        run_cluster("down", state_dir, timeout=120)
