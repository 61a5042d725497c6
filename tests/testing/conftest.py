"""The harness's own tests run it the way a user does: through the ``distlib_cluster`` fixture
of its pytest plugin (registered by the package's entry point)."""

import pytest

from distlib.testing import namespaces


@pytest.fixture
def needs_namespaces():
    """Skip where hosts cannot be namespaces (no root, no passwordless sudo)."""
    why = namespaces.unavailable()
    if why:
        pytest.skip(f"hosts as namespaces cannot be made here: {why}")


@pytest.fixture
def hosts(request, distlib_cluster, distlib_substrate):
    """``hosts(nodes=3, **options)``: the plugin's cluster, on the project's own image for the
    container substrate (built from this tree by tests/fixtures/docker.py), and skipped where
    the process substrate cannot have namespaces."""

    def make(nodes: int = 3, **options):
        if distlib_substrate == "containers":
            options.setdefault("image", request.getfixturevalue("distlib_image"))
        elif options.get("namespaces", True):
            request.getfixturevalue("needs_namespaces")
        return distlib_cluster(nodes=nodes, **options)

    return make


def pytest_collection_modifyitems(items):
    """A test parametrized onto the container substrate carries the suite's ``containers``
    marker (``make test-unit`` leaves those out)."""
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is not None and callspec.params.get("distlib_substrate") == "containers":
            item.add_marker(pytest.mark.containers)
