"""Suite-wide plugins: the Docker fixtures (tests/fixtures/docker.py) for the container lanes,
the check that holds every test to its lane's marker (tests/support/lanes.py), and the
distlib.testing plugin (tests/testing, tests/containers) where its entry point is not installed:
``make test-interop`` imports this checkout through PYTHONPATH into the torch environment."""

from importlib.metadata import entry_points

_HARNESS_INSTALLED = any(e.name == "distlib_testing" for e in entry_points(group="pytest11"))
pytest_plugins = ["tests.fixtures.docker", "tests.support.lanes"] + (
    [] if _HARNESS_INSTALLED else ["distlib.testing.plugin"])
