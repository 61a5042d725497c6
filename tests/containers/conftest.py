"""Fixtures of the container tests beyond tests/fixtures/docker.py."""

from __future__ import annotations

import pytest

from tests.containers._ranks import named_volumes


@pytest.fixture
def named_volume(docker_client):
    """Factory: ``named_volume(hint)`` → a new labelled docker-py Volume, removed after the test
    (with any container still using it)."""
    with named_volumes(docker_client) as make:
        yield make
