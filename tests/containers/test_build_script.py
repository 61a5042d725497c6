"""docker/build-image.sh and docker/Dockerfile without a Docker engine: how the script fails
when Docker is missing or down, where it takes the Debian mirror from, and the Dockerfile's
offline rules. Not marked ``containers``: these run everywhere (`make test-unit` too)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.fixtures.docker import BUILD_SCRIPT, REPO_ROOT

DOCKERFILE = REPO_ROOT / "docker" / "Dockerfile"


def run_script(*args: str, env: dict[str, str] | None = None, path: str | None = None) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if k not in ("BASE_IMAGE", "DEBIAN_MIRROR")}
    full_env.update(env or {})
    if path is not None:
        full_env["PATH"] = path
    return subprocess.run(
        [shutil.which("bash") or "/bin/bash", str(BUILD_SCRIPT), *args],
        cwd=REPO_ROOT, env=full_env, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
    )


def one_message(proc: subprocess.CompletedProcess) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one line on stderr, got:\n{proc.stderr}"
    assert lines[0].startswith("build-image: ")
    return lines[0]


def test_engine_down_is_one_line():
    proc = run_script(env={"DOCKER_HOST": "unix:///nonexistent/docker.sock"})
    assert proc.returncode != 0
    message = one_message(proc)
    if shutil.which("docker"):
        assert "cannot reach the Docker engine" in message
        assert "/nonexistent/docker.sock" in message
    else:
        assert "docker is not installed" in message


def test_docker_cli_missing_is_one_line(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("dirname", "mkdir"):  # what the script runs before it looks for docker
        os.symlink(shutil.which(tool), bin_dir / tool)
    proc = run_script(path=str(bin_dir))
    assert proc.returncode != 0
    assert "docker is not installed" in one_message(proc)


def test_unknown_argument():
    proc = run_script("--frobnicate")
    assert proc.returncode != 0
    assert "unknown argument" in one_message(proc)


# --- the Debian mirror for debootstrap ---------------------------------------------------------
# Host names below are under .example (reserved): no real mirror is named in the repository.


def apt_tree(tmp_path: Path, deb822: str = "", one_line: str = "", os_id: str = "debian") -> dict[str, str]:
    etc = tmp_path / "apt"
    (etc / "sources.list.d").mkdir(parents=True)
    if deb822:
        (etc / "sources.list.d" / "debian.sources").write_text(deb822)
    if one_line:
        (etc / "sources.list").write_text(one_line)
    (etc / "sources.list.d" / "other.sources.disabled").write_text(
        "Types: deb\nURIs: http://disabled.example/debian\nSuites: bookworm\n"
    )
    os_release = tmp_path / "os-release"
    os_release.write_text(f"ID={os_id}\nVERSION_CODENAME=bookworm\n")
    return {"APT_ETC": str(etc), "OS_RELEASE": str(os_release)}


def test_mirror_from_deb822_sources(tmp_path):
    env = apt_tree(tmp_path, deb822=(
        "Types: deb\n"
        "# a comment\n"
        "URIs: http://security.example/debian-security\n"
        "Suites: bookworm-security\n"
        "Components: main\n"
        "\n"
        "Types: deb-src\n"
        "URIs: http://source.example/debian\n"
        "Suites: bookworm\n"
        "\n"
        "Types: deb\n"
        "URIs: http://off.example/debian\n"
        "Suites: bookworm\n"
        "Enabled: no\n"
        "\n"
        "Types: deb\n"
        "URIs: http://main.example/debian http://second.example/debian\n"
        "Suites: bookworm bookworm-updates\n"
        "Components: main\n"
    ))
    proc = run_script("--print-debian-mirror", env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "http://main.example/debian"


def test_mirror_from_one_line_sources(tmp_path):
    env = apt_tree(tmp_path, one_line=(
        "# deb http://commented.example/debian bookworm main\n"
        "deb-src http://source.example/debian bookworm main\n"
        "deb [signed-by=/usr/share/keyrings/k.gpg arch=amd64] http://security.example/debian-security bookworm-security main\n"
        "deb [signed-by=/usr/share/keyrings/k.gpg] https://main.example/debian bookworm main\n"
    ))
    proc = run_script("--print-debian-mirror", env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "https://main.example/debian"


def test_mirror_of_another_release_is_used_when_no_bookworm_source(tmp_path):
    env = apt_tree(tmp_path, deb822="Types: deb\nURIs: http://main.example/debian\nSuites: trixie trixie-updates\n")
    proc = run_script("--print-debian-mirror", env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "http://main.example/debian"


def test_mirror_on_a_non_debian_host_needs_DEBIAN_MIRROR(tmp_path):
    env = apt_tree(tmp_path, deb822="Types: deb\nURIs: http://ubuntu.example/ubuntu\nSuites: noble\n", os_id="ubuntu")
    proc = run_script("--print-debian-mirror", env=env)
    assert proc.returncode != 0
    assert "DEBIAN_MIRROR" in one_message(proc)
    env["DEBIAN_MIRROR"] = "http://given.example/debian"
    proc = run_script("--print-debian-mirror", env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "http://given.example/debian"


def test_no_mirror_found(tmp_path):
    proc = run_script("--print-debian-mirror", env=apt_tree(tmp_path))
    assert proc.returncode != 0
    assert "DEBIAN_MIRROR" in one_message(proc)


# --- static rules ------------------------------------------------------------------------------


def test_dockerfile_offline_rules():
    text = DOCKERFILE.read_text()
    instructions = [line for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    assert instructions[0] == "ARG BASE_IMAGE=python:3.11-slim-bookworm"  # the public default
    assert not re.search(r"^#\s*syntax\s*=", text, re.M)  # BuildKit would pull a frontend image
    assert re.search(r"^FROM \S+ AS cpu$", text, re.M)
    for line in text.splitlines():
        if "pip install" in line and not line.strip().startswith("#"):
            assert "--no-index" in line, line
    assert "USER 1000:1000" in text


def test_shellcheck_clean():
    shellcheck = shutil.which("shellcheck")
    if shellcheck is None:
        pytest.skip("shellcheck is not installed (apt-get install shellcheck)")
    proc = subprocess.run([shellcheck, str(BUILD_SCRIPT)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout
