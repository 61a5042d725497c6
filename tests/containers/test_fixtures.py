"""The container fixtures themselves (tests/fixtures/docker.py): skip-or-fail without an engine,
labelled containers and the sweep of leftovers."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from tests.fixtures.docker import (
    REPO_ROOT,
    TEST_LABELS,
    labelled,
    sweep,
)

# --- no engine: skip, or fail under DISTLIB_REQUIRE_DOCKER=1 (no Docker needed for these) -------


def run_pytest_without_engine(tmp_path, require: str | None) -> subprocess.CompletedProcess:
    test_file = tmp_path / "test_needs_docker.py"
    test_file.write_text(textwrap.dedent("""
        def test_uses_docker(docker_client):
            pass
    """))
    # An empty ini of its own, so that the project's pytest settings stay out (pytest 9
    # refuses "-c /dev/null": a config file must end in .ini, .cfg or .toml).
    config = tmp_path / "pytest.ini"
    config.write_text("[pytest]\n")
    env = {k: v for k, v in os.environ.items() if k != "DISTLIB_REQUIRE_DOCKER"}
    env["DOCKER_HOST"] = "unix:///nonexistent/docker.sock"
    env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    if require is not None:
        env["DISTLIB_REQUIRE_DOCKER"] = require
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "tests.fixtures.docker", "-p", "no:cacheprovider",
         "-rsf", "--rootdir", str(tmp_path), "-c", str(config), str(test_file)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )


def test_no_engine_skips_with_the_reason(tmp_path):
    pytest.importorskip("docker")
    proc = run_pytest_without_engine(tmp_path, require=None)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 skipped" in proc.stdout
    assert "no Docker engine reachable" in proc.stdout


def test_no_engine_fails_when_docker_is_required(tmp_path):
    pytest.importorskip("docker")
    proc = run_pytest_without_engine(tmp_path, require="1")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "1 error" in proc.stdout  # pytest.fail in a fixture: an error, exit code 1
    assert "DISTLIB_REQUIRE_DOCKER=1" in proc.stdout


# --- with an engine ------------------------------------------------------------------------------


@pytest.mark.containers
def test_sweep_removes_orphans_and_spares_live_sessions(docker_client, distlib_image):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    orphan_labels = {**TEST_LABELS, "distlib.test.session": "deadbeef0000", "distlib.test.pid": str(dead.pid)}
    live_labels = {**TEST_LABELS, "distlib.test.session": "alive0000000", "distlib.test.pid": str(os.getppid())}
    orphan = docker_client.containers.create(distlib_image, "true", labels=orphan_labels)
    live = docker_client.containers.create(distlib_image, "true", labels=live_labels)
    try:
        removed = sweep(docker_client)
        assert f"container {orphan.name}" in removed
        assert f"container {live.name}" not in removed
        live.reload()  # still there
    finally:
        for ctr in (orphan, live):
            try:
                ctr.remove(force=True)
            except Exception:
                pass


def test_labels_name_this_session():
    assert labelled({"x": "1"}) == {**TEST_LABELS, "x": "1"}
    assert TEST_LABELS["distlib.test.pid"] == str(os.getpid())
