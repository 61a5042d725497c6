"""The test suite's own ``DISTLIB_*`` switches (docs/settings.md, "The test suite").

They live with the tests, not in the library's ``distlib.settings``: no user of the library sets
them. The same rule for flags and text as the library's (``distlib.settings.flag``/``text``).
"""

from __future__ import annotations

import os
from typing import Mapping, Optional

from distlib.settings import flag, text


def require_docker(env: Optional[Mapping[str, str]] = None) -> bool:
    """DISTLIB_REQUIRE_DOCKER: container tests fail instead of skipping without an engine."""
    return flag("DISTLIB_REQUIRE_DOCKER", False, env)


def require_mpi(env: Optional[Mapping[str, str]] = None) -> bool:
    """DISTLIB_REQUIRE_MPI: the MPI tests fail instead of skipping without mpi4py and an MPI."""
    return flag("DISTLIB_REQUIRE_MPI", False, env)


def container_image(env: Optional[Mapping[str, str]] = None) -> str:
    """DISTLIB_TEST_IMAGE: an existing image for the container tests, or "" to build one."""
    return text("DISTLIB_TEST_IMAGE", env=env)


def cache_dir(env: Optional[Mapping[str, str]] = None) -> str:
    """DISTLIB_CACHE: where the test lanes keep what they build once (VM images, the Kubernetes
    build, the torch environment): default ~/.cache/distlib."""
    return text("DISTLIB_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "distlib"), env)


def compose_v2(env: Optional[Mapping[str, str]] = None) -> str:
    """DISTLIB_COMPOSE_V2: a Compose v2 binary the cluster tests also use, or ""."""
    return text("DISTLIB_COMPOSE_V2", env=env)
