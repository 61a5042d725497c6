"""The harness's own tests run it the way a user does: through the ``distlib_cluster`` fixture
of its pytest plugin (registered by the package's entry point)."""

import pytest

from distlib.testing import privilege


@pytest.fixture
def needs_namespaces():
    """Skip where hosts cannot be namespaces (no root, no passwordless sudo)."""
    why = privilege.why_not()
    if why:
        pytest.skip(f"hosts as namespaces need root: {why}")
