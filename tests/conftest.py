"""Suite-wide plugins: the Docker fixtures (tests/fixtures/docker.py) for the container lanes,
and the check that holds every test to its lane's marker (tests/support/lanes.py)."""

pytest_plugins = ["tests.fixtures.docker", "tests.support.lanes"]
