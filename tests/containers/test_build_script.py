"""docker/build-image.sh, docker/offline-prepare.sh and docker/Dockerfile without a Docker
engine: how the scripts fail when Docker is missing or down, where the offline step takes the
Debian mirror from, the Dockerfile's two ways (a plain build with pip's index, the offline
build with the prepared wheelhouse) and what a plain build's context holds. Not marked
``containers``: these run everywhere (`make test-unit` too)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.fixtures.docker import BUILD_SCRIPT, REPO_ROOT

DOCKERFILE = REPO_ROOT / "docker" / "Dockerfile"
PREPARE_SCRIPT = REPO_ROOT / "docker" / "offline-prepare.sh"


def run_script(*args: str, env: dict[str, str] | None = None, path: str | None = None,
               script: Path = BUILD_SCRIPT) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if k not in ("BASE_IMAGE", "DEBIAN_MIRROR")}
    full_env.update(env or {})
    if path is not None:
        full_env["PATH"] = path
    return subprocess.run(
        [shutil.which("bash") or "/bin/bash", str(script), *args],
        cwd=REPO_ROOT, env=full_env, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
    )


def one_message(proc: subprocess.CompletedProcess, prefix: str = "offline-prepare: ") -> str:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one line on stderr, got:\n{proc.stderr}"
    assert lines[0].startswith(prefix)
    return lines[0]


@pytest.mark.parametrize("script", [BUILD_SCRIPT, PREPARE_SCRIPT], ids=["build-image", "offline-prepare"])
def test_engine_down_is_one_line(script):
    """make image on a machine whose engine is down: one line, from the offline step (the
    first that needs the engine), and nothing is built."""
    proc = run_script(env={"DOCKER_HOST": "unix:///nonexistent/docker.sock"}, script=script)
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
    for tool in ("dirname", "mkdir"):  # what the scripts run before they look for docker
        os.symlink(shutil.which(tool), bin_dir / tool)
    proc = run_script(path=str(bin_dir))
    assert proc.returncode != 0
    assert "docker is not installed" in one_message(proc)


@pytest.mark.parametrize("script, prefix", [(BUILD_SCRIPT, "build-image: "), (PREPARE_SCRIPT, "offline-prepare: ")])
def test_unknown_argument(script, prefix):
    proc = run_script("--frobnicate", script=script)
    assert proc.returncode != 0
    assert "unknown argument" in one_message(proc, prefix)


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
    proc = run_script("--print-debian-mirror", env=env, script=PREPARE_SCRIPT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "http://main.example/debian"


def test_mirror_from_one_line_sources(tmp_path):
    env = apt_tree(tmp_path, one_line=(
        "# deb http://commented.example/debian bookworm main\n"
        "deb-src http://source.example/debian bookworm main\n"
        "deb [signed-by=/usr/share/keyrings/k.gpg arch=amd64] http://security.example/debian-security bookworm-security main\n"
        "deb [signed-by=/usr/share/keyrings/k.gpg] https://main.example/debian bookworm main\n"
    ))
    proc = run_script("--print-debian-mirror", env=env, script=PREPARE_SCRIPT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "https://main.example/debian"


def test_mirror_of_another_release_is_used_when_no_bookworm_source(tmp_path):
    env = apt_tree(tmp_path, deb822="Types: deb\nURIs: http://main.example/debian\nSuites: trixie trixie-updates\n")
    proc = run_script("--print-debian-mirror", env=env, script=PREPARE_SCRIPT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "http://main.example/debian"


def test_mirror_on_a_non_debian_host_needs_DEBIAN_MIRROR(tmp_path):
    env = apt_tree(tmp_path, deb822="Types: deb\nURIs: http://ubuntu.example/ubuntu\nSuites: noble\n", os_id="ubuntu")
    proc = run_script("--print-debian-mirror", env=env, script=PREPARE_SCRIPT)
    assert proc.returncode != 0
    assert "DEBIAN_MIRROR" in one_message(proc)
    env["DEBIAN_MIRROR"] = "http://given.example/debian"
    proc = run_script("--print-debian-mirror", env=env, script=PREPARE_SCRIPT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "http://given.example/debian"


def test_no_mirror_found(tmp_path):
    proc = run_script("--print-debian-mirror", env=apt_tree(tmp_path), script=PREPARE_SCRIPT)
    assert proc.returncode != 0
    assert "DEBIAN_MIRROR" in one_message(proc)


# --- static rules ------------------------------------------------------------------------------


def instructions(text: str) -> list[str]:
    """The Dockerfile's instructions, continuation lines joined, comments dropped."""
    joined = re.sub(r"\\\n", " ", "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#")))
    return [line.strip() for line in joined.splitlines() if line.strip()]


def test_dockerfile_builds_both_ways():
    text = DOCKERFILE.read_text()
    steps = instructions(text)
    assert steps[0] == "ARG BASE_IMAGE=python:3.11-slim-bookworm"  # the public default
    assert not re.search(r"^#\s*syntax\s*=", text, re.M)  # BuildKit would pull a frontend image
    # the cuda target's stages come after cpu: the classic builder builds every stage up to the
    # target, so a cpu build never downloads or installs the GPU wheels
    assert [s.split()[-1] for s in steps if s.startswith("FROM ")] == [
        "runtime", "wheelhouse", "venv", "cpu", "gpu-wheelhouse", "cuda-venv", "cuda"]
    # every install is from a wheelhouse; the downloads are the plain build's `pip wheel` and
    # `pip download` of the [gpu] extra, from pip's default index, each in the branch taken when
    # no prepared wheelhouse is there
    installs = [s for s in steps if "pip install" in s]
    assert installs and all("--no-index" in s for s in installs), installs
    (wheelhouse,) = [s for s in steps if "pip wheel" in s]
    assert "if [ -s /wheels/app/requirements.txt ]" in wheelhouse
    assert wheelhouse.index("pip wheel") > wheelhouse.index("else")
    (gpu_wheelhouse,) = [s for s in steps if "pip download" in s]
    assert "if [ -s /wheels/gpu/requirements.txt ]" in gpu_wheelhouse
    assert gpu_wheelhouse.index("pip download") > gpu_wheelhouse.index("else")
    assert '"${app}[gpu]"' in gpu_wheelhouse  # the [gpu] extra of pyproject.toml, nothing else
    pip_calls = [c for s in steps for c in re.findall(r"pip (?:install|wheel|download)[^;]*", s)]
    assert not [c for c in pip_calls if re.search(r"index-url|trusted-host|\s-i\s", c)]  # pip's default index only
    # what the offline step fills, and only those, reach the layers
    assert "COPY docker/offline/debs/ /tmp/debs/" in steps and "COPY docker/offline/wheels/ /wheels/" in steps
    assert "COPY docker/offline/gpu-wheels/ /wheels/gpu/" in steps
    # both images run as the unprivileged user; the cuda one says what it finds by default
    cuda = steps[[s.split()[-1] for s in steps].index("cuda"):]
    assert steps[-1] == "USER 1000:1000"  # cuda's
    assert steps[steps.index("FROM ${BASE_IMAGE} AS gpu-wheelhouse") - 1] == "USER 1000:1000"  # cpu's
    assert 'CMD ["distlib", "gpu-info"]' in cuda


def test_the_repository_has_the_directories_the_dockerfile_copies():
    for rel in ("docker/offline/debs", "docker/offline/wheels", "docker/offline/gpu-wheels"):
        directory = REPO_ROOT / rel
        assert directory.is_dir() and not list(directory.glob("*.whl")) and not list(directory.glob("*.deb"))


def test_a_plain_build_sends_only_what_the_dockerfile_copies():
    """`docker build -f docker/Dockerfile .` from a checkout: .dockerignore keeps .venv, .build,
    .git and the tests out of the context (the engine would receive them all)."""
    docker_build = pytest.importorskip("docker.utils.build")
    patterns = [p for p in (REPO_ROOT / ".dockerignore").read_text().splitlines() if p and not p.startswith("#")]
    sent = docker_build.exclude_paths(str(REPO_ROOT), patterns, dockerfile="docker/Dockerfile")
    files = {p for p in sent if (REPO_ROOT / p).is_file()}
    allowed = ("pyproject.toml", "README.md", "distlib/", "deploy/pyproject.toml", "deploy/distlib_deploy/",
               "docker/offline/", "docker/Dockerfile", ".dockerignore")
    assert files and all(p.startswith(allowed) for p in files), sorted(p for p in files if not p.startswith(allowed))
    assert "distlib/__init__.py" in files and "deploy/distlib_deploy/jobs/train_dp.py" in files
    assert not any(p.startswith("bench/") for p in files)  # the benchmarks are not in the image
    assert "docker/offline/debs/.keep" in files and "docker/offline/wheels/.keep" in files
    assert "docker/offline/gpu-wheels/.keep" in files
    assert not any("__pycache__" in p or p.endswith(".pyc") for p in files)


def shell_scripts() -> list:
    """Every shell script of the repository: the tracked files named *.sh or starting with a
    sh/bash shebang (.ci/run), so that a new script is linted without being listed here."""
    try:
        tracked = subprocess.run(["git", "ls-files", "-z"], cwd=REPO_ROOT, capture_output=True, check=True,
                                 timeout=60).stdout.decode().split("\0")
    except (OSError, subprocess.SubprocessError):  # not a git checkout: the scripts by name
        tracked = [str(p.relative_to(REPO_ROOT)) for p in REPO_ROOT.rglob("*.sh") if ".venv" not in p.parts]
    found = []
    for name in filter(None, tracked):
        path = REPO_ROOT / name
        if not path.is_file():
            continue
        if name.endswith(".sh"):
            found.append(path)
            continue
        with open(path, "rb") as fh:
            if re.match(rb"#!\s*\S*/(env\s+)?(ba|da)?sh\b", fh.readline(64)):
                found.append(path)
    return sorted(found)


def test_the_lint_finds_the_scripts():
    scripts = shell_scripts()
    assert {BUILD_SCRIPT, PREPARE_SCRIPT, REPO_ROOT / ".ci" / "run"} <= set(scripts), scripts


@pytest.mark.parametrize("script", shell_scripts(), ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_shellcheck_clean(script):
    shellcheck = shutil.which("shellcheck")
    if shellcheck is None:
        pytest.skip("shellcheck is not installed (apt-get install shellcheck)")
    proc = subprocess.run([shellcheck, str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout
