"""Suite-wide fixtures: Docker (tests/fixtures/docker.py) for the container tests."""

pytest_plugins = ["tests.fixtures.docker"]
