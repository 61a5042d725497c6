"""The distlib image itself (docker/Dockerfile target cpu), as `make image` builds it
(docker/build-image.sh: docker/offline-prepare.sh, then the Dockerfile with --network=none) and
as a plain `docker build -f docker/Dockerfile .` with pip's default index builds it.

Needs a Docker engine (marker ``containers``); uses the fixtures of tests/fixtures/docker.py.
The image under test is built once per session (or named by DISTLIB_TEST_IMAGE).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

from tests.fixtures.docker import (
    DEBOOTSTRAP_BASE,
    REPO_ROOT,
    exec_text,
    idle_container,
    labelled,
    run_build_script,
    run_default_command,
    temp_image_tag,
)
from tests.support.image_contents import DIST_NAME, VENV, repo_version, working_tree_sources

pytestmark = pytest.mark.containers

# A guard against accidental growth (today: ~215 MB on the debootstrap base).
SIZE_BUDGET_BYTES = 350_000_000


@pytest.fixture(scope="module")
def image(docker_client, distlib_image):
    """The docker-py Image object of the image under test."""
    return docker_client.images.get(distlib_image)


@pytest.fixture(scope="module")
def box(distlib_image):
    """One long-running container of the image for the read-only checks of this module."""
    with idle_container(distlib_image) as ctr:
        yield ctr


def run_ok(box, command: str | list[str]) -> str:
    code, out = exec_text(box, command)
    assert code == 0, f"{command!r} exited {code}:\n{out}"
    return out.strip()


# --- who and where -------------------------------------------------------------------------------


def test_runs_as_unprivileged_user(box, image):
    assert image.attrs["Config"]["User"] == "1000:1000"  # numeric: runAsNonRoot can check it
    assert run_ok(box, "id -u") == "1000"
    assert run_ok(box, "id -g") == "1000"
    assert run_ok(box, "id -un") == "distlib"
    code, _ = exec_text(box, "touch /opt/distlib/should-not-write")
    assert code != 0, "the venv must not be writable by the runtime user"


def test_home_workdir_and_shared_mount_point_are_writable(box):
    assert run_ok(box, "pwd") == "/workspace"
    assert run_ok(box, 'echo "$HOME"') == "/home/distlib"
    # /var/lib/distlib/master: the master service's --state-dir (compose/mode-tcp.yml)
    for directory in ("$HOME", "/workspace", "/shared", "/tmp", "/var/lib/distlib/master"):
        run_ok(box, f'f="{directory}/probe.$$" && echo ok > "$f" && cat "$f" && rm "$f"')


def test_environment(image, box):
    env = dict(item.split("=", 1) for item in image.attrs["Config"]["Env"])
    assert env.get("PYTHONUNBUFFERED") == "1"
    assert env.get("VIRTUAL_ENV") == VENV
    assert env["PATH"].split(":")[0] == f"{VENV}/bin"
    assert run_ok(box, "python -c 'import sys; print(sys.stdout.write_through)'") == "True"


def test_venv_is_first_on_path(box):
    assert run_ok(box, "command -v python") == f"{VENV}/bin/python"
    assert run_ok(box, "python -c 'import sys; print(sys.prefix)'") == VENV
    assert run_ok(box, "python -c 'import sys; print(\"%d.%d\" % sys.version_info[:2])'") == "3.11"
    for script in ("distlib", "distlib-run"):
        assert run_ok(box, f"command -v {script}") == f"{VENV}/bin/{script}"


def test_debugging_tools(box):
    assert "iproute2" in run_ok(box, "ip -V")
    assert "lo" in run_ok(box, "ip -o link show lo")
    assert "sleep" in run_ok(box, "ps -o comm= -p 1")


def test_mpi_and_ssh_for_cluster_mode_mpi(box):
    """What MODE=mpi runs: Open MPI and mpi4py from the wheels (the mpi extra), the SSH client
    and server from Debian. No host keys are baked in (every container would share them)."""
    assert run_ok(box, "command -v mpirun") == f"{VENV}/bin/mpirun"
    assert run_ok(box, "command -v prted") == f"{VENV}/bin/prted"
    out = run_ok(box, ["python", "-c", "from mpi4py import MPI; print(MPI.Get_library_version().split(',')[0])"])
    assert out.startswith("Open MPI v5"), out
    assert "OpenSSH" in run_ok(box, "ssh -V 2>&1")
    for tool in ("ssh-keygen", "ssh-keyscan"):
        run_ok(box, f"command -v {tool}")
    run_ok(box, "test -x /usr/sbin/sshd")
    assert run_ok(box, "ls /etc/ssh/ | grep -c '^ssh_host_' || true") == "0"


# --- what is installed --------------------------------------------------------------------------


def test_distlib_and_numpy_import(box):
    out = run_ok(box, ["python", "-c", "import distlib, numpy; print(distlib.__file__); print(int(numpy.arange(5).sum()))"])
    path, total = out.splitlines()
    assert path.startswith(f"{VENV}/lib/python3.11/site-packages/distlib/")
    assert total == "10"


def test_installed_version_is_the_working_trees(box, image):
    version = repo_version()
    assert run_ok(box, ["python", "-c", f"import importlib.metadata as m; print(m.version({DIST_NAME!r}))"]) == version
    assert image.labels.get("org.opencontainers.image.version") == version


def test_installed_sources_are_the_working_trees(box):
    """Every .py of the package in the image is byte-for-byte the working tree's: the image is not
    stale (with DISTLIB_TEST_IMAGE naming an older image this fails, as it should)."""
    expected = working_tree_sources()
    assert expected, "found no sources under distlib/"
    script = (
        "import hashlib, json, pathlib, distlib\n"
        "root = pathlib.Path(distlib.__file__).parent\n"
        "print(json.dumps({str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()"
        " for p in root.rglob('*.py')}))\n"
    )
    installed = json.loads(run_ok(box, ["python", "-c", script]))
    missing = sorted(set(expected) - set(installed))
    extra = sorted(set(installed) - set(expected))
    changed = sorted(p for p in set(expected) & set(installed) if expected[p] != installed[p])
    assert not (missing or extra or changed), (
        f"image differs from the working tree (rebuild: make image): missing {missing}, extra {extra}, "
        f"changed {changed}"
    )


def test_built_offline_from_the_wheelhouse(box, image):
    """Packages came from the wheelhouse with --no-index (the history records the command), and
    the wheelhouse itself is not in the image."""
    history = " ".join(layer.get("CreatedBy", "") for layer in image.history())
    # (the dependencies' install ran in the venv stage, whose history is not the image's; the
    # static test in test_build_script.py checks that every pip install has --no-index)
    assert "pip install --no-index --find-links=/tmp/wheels/app" in history
    run_ok(box, "test ! -e /tmp/wheels")
    # no index configured anywhere pip would look
    assert "index" not in run_ok(box, "pip config list")
    assert "PIP_INDEX_URL" not in run_ok(box, "env")
    # pip installed both; numpy is a manylinux wheel for this Python (no compiler ran)
    assert run_ok(box, f"cat {VENV}/lib/python3.11/site-packages/numpy-*.dist-info/INSTALLER") == "pip"
    wheel_tags = run_ok(box, f"cat {VENV}/lib/python3.11/site-packages/numpy-*.dist-info/WHEEL")
    assert "Tag: cp311-cp311-manylinux" in wheel_tags


def test_setuptools_is_not_shipped(box):
    code, _ = exec_text(box, ["python", "-c", "import setuptools"])
    assert code != 0


def test_default_command(image, distlib_image):
    assert image.attrs["Config"]["Cmd"] == ["distlib", "--help"]
    code, stdout, stderr = run_default_command(distlib_image)
    text = (stdout + stderr).decode(errors="replace")
    assert code == 0, text
    assert "store-server" in text


def test_size_budget(image):
    assert image.attrs["Size"] < SIZE_BUDGET_BYTES, (
        f"image is {image.attrs['Size'] / 1e6:.0f} MB, budget {SIZE_BUDGET_BYTES / 1e6:.0f} MB"
    )


# --- BASE_IMAGE ------------------------------------------------------------------------------------


def _base_or_skip(docker_client, base: str) -> None:
    import docker

    try:
        docker_client.images.get(base)
    except docker.errors.ImageNotFound:
        if os.geteuid() != 0:
            pytest.skip(f"{base} is missing and building it needs root (debootstrap)")


def _layers(docker_client, ref: str) -> list[str]:
    return docker_client.images.get(ref).attrs["RootFS"]["Layers"]


def test_base_image_debootstrap_explicit(docker_client, distlib_image):
    """BASE_IMAGE=distlib-base:bookworm: the image is built on it (its layers come first) and is
    Debian bookworm. Quick when the session image was built on the same base (cached layers)."""
    _base_or_skip(docker_client, DEBOOTSTRAP_BASE)
    tag = temp_image_tag("debootstrap-base")
    try:
        run_build_script(tag, base_image=DEBOOTSTRAP_BASE)
        built = docker_client.images.get(tag)
        assert built.labels.get("distlib.base-image") == DEBOOTSTRAP_BASE
        base_layers = _layers(docker_client, DEBOOTSTRAP_BASE)
        assert _layers(docker_client, tag)[: len(base_layers)] == base_layers
        out = docker_client.containers.run(
            tag, ["sh", "-c", ". /etc/os-release && echo $ID $VERSION_CODENAME"],
            remove=True, network_mode="none", labels=labelled(),
        ).decode().strip()
        assert out == "debian bookworm"
    finally:
        if _exists(docker_client, tag):
            docker_client.images.remove(tag, force=True)


def test_base_image_custom_without_debug_tools(docker_client, distlib_image, image):
    """A base of our own making: the marker file it carries shows up in the image (BASE_IMAGE is
    honoured), and although it lacks ip, ps, ssh and sshd (as python:3.11-slim does) the image
    has them, installed from .deb files the host's apt fetched: the build itself ran with no
    network; the SSH host keys openssh-server's postinst makes are removed."""
    base_of_session_image = image.labels.get("distlib.base-image")
    assert base_of_session_image, "the image has no distlib.base-image label"
    host_apt = shutil.which("apt-get") and _host_codename() == "bookworm"
    strip_tools = (
        "dpkg --purge openssh-server openssh-sftp-server openssh-client iproute2 procps && "
        "! command -v ip && ! command -v ps && ! command -v ssh && ! test -e /usr/sbin/sshd && "
        if host_apt and base_of_session_image == DEBOOTSTRAP_BASE
        else ""
    )
    dockerfile = (
        f"FROM {base_of_session_image}\n"
        "USER 0\n"
        f"RUN {strip_tools}echo distlib-test-base > /etc/distlib-test-base\n"
    )
    base_tag = temp_image_tag("custom-base")
    tag = temp_image_tag("on-custom-base")
    try:
        docker_client.images.build(
            fileobj=io.BytesIO(dockerfile.encode()), tag=base_tag, pull=False, rm=True, forcerm=True,
            network_mode="none", labels=labelled(),
        )
        run_build_script(tag, base_image=base_tag)
        built = docker_client.images.get(tag)
        assert built.labels.get("distlib.base-image") == base_tag
        base_layers = _layers(docker_client, base_tag)
        assert _layers(docker_client, tag)[: len(base_layers)] == base_layers
        out = docker_client.containers.run(
            tag,
            ["sh", "-c", "cat /etc/distlib-test-base && ip -V && ps -p 1 -o comm= && ssh -V 2>&1 && "
                         "test -x /usr/sbin/sshd && ! ls /etc/ssh/ssh_host_* 2>/dev/null && id -u && "
                         "python -c 'import distlib, numpy'"],
            remove=True, network_mode="none", labels=labelled(),
        ).decode()
        lines = out.strip().splitlines()
        assert lines[0] == "distlib-test-base"
        assert "iproute2" in lines[1]
        assert "OpenSSH" in lines[3]  # and sshd, with no host keys baked in
        assert lines[-1] == "1000"
    finally:
        _remove_built_on(docker_client, base_tag)
        for ref in (tag, base_tag):
            if _exists(docker_client, ref):
                docker_client.images.remove(ref, force=True)


def _remove_built_on(docker_client, base: str) -> None:
    """Drop the untagged stage images (wheelhouse, venv: build cache) that a build on ``base`` left."""
    filters = {"dangling": True, "label": [f"distlib.base-image={base}"]}
    for img in docker_client.images.list(filters=filters):
        if img.labels.get("distlib.stage"):
            docker_client.images.remove(img.id, force=True)


def _exists(docker_client, ref: str) -> bool:
    import docker

    try:
        docker_client.images.get(ref)
        return True
    except docker.errors.ImageNotFound:
        return False


def _host_codename() -> str:
    try:
        for line in Path("/etc/os-release").read_text().splitlines():
            if line.startswith("VERSION_CODENAME="):
                return line.split("=", 1)[1].strip().strip('"')
    except OSError:
        pass
    return ""



# --- the two ways to build -------------------------------------------------------------------------


def test_the_offline_step_lays_out_a_context_shaped_like_the_repository(image):
    """docker/offline-prepare.sh on its own, for the session image's base (seconds: nothing
    changed since the session's build): the working tree's sources, the prepared wheelhouse in
    docker/offline/wheels/, and the build's arguments for the Dockerfile."""
    base = image.labels["distlib.base-image"]
    env = {k: v for k, v in os.environ.items() if k != "IMAGE"}
    env.update(BASE_IMAGE=base, DISTLIB_NO_PULL="1")
    done = subprocess.run(["bash", str(REPO_ROOT / "docker" / "offline-prepare.sh")], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr
    assert done.stdout == ""  # logs on stderr only
    context = REPO_ROOT / ".build" / "image-context"
    wheels = context / "docker" / "offline" / "wheels"
    # the library's wheel and the deployment's (the jobs the image runs)
    assert sorted((wheels / "app" / "requirements.txt").read_text().split()) == [
        f"distlib_c10d=={repo_version()}", f"distlib_c10d_deploy=={repo_version('deploy')}"]
    deps = (wheels / "deps" / "requirements.txt").read_text().split()
    assert any(d.startswith("numpy==") for d in deps), deps
    for rel, digest in working_tree_sources().items():
        assert hashlib.sha256((context / "distlib" / rel).read_bytes()).hexdigest() == digest, rel
    build_env = dict(line.split("=", 1) for line in (REPO_ROOT / ".build" / "image-build.env").read_text().split())
    assert build_env["BASE_IMAGE"] == base
    assert build_env["DISTLIB_VERSION"] == repo_version()
    assert build_env["BUILD_NETWORK"] in ("none", "default")


def test_a_plain_build_with_pips_default_index(docker_client, distlib_image, image):
    """`docker build -f docker/Dockerfile .` from the checkout, as a user with a registry and an
    index runs it: no prepared wheelhouse, the wheels come from pip's default index. Built on
    the session image's base (there is no registry here to give python:3.11-slim), to which the
    host's CA bundle is added when it has one: behind a TLS-inspecting proxy, pip in a container
    trusts what the host trusts only that way. Skipped when no index answers inside a build."""
    import docker

    base = image.labels["distlib.base-image"]
    ca = Path("/etc/ssl/certs/ca-certificates.crt")
    base_tag, tag = temp_image_tag("plain-base"), temp_image_tag("plain-build")
    dockerfile = f"FROM {base}\n" + ("COPY ca.crt /etc/ssl/certs/ca-certificates.crt\n"
                                     "ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt\n" if ca.is_file() else "")
    context = io.BytesIO()
    with tarfile.open(fileobj=context, mode="w") as tar:
        for name, data in [("Dockerfile", dockerfile.encode())] + ([("ca.crt", ca.read_bytes())] if ca.is_file() else []):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    context.seek(0)
    try:
        docker_client.images.build(fileobj=context, custom_context=True, tag=base_tag, pull=False, rm=True,
                                   labels=labelled())
        try:
            built, log = docker_client.images.build(path=str(REPO_ROOT), dockerfile="docker/Dockerfile", tag=tag,
                                                    buildargs={"BASE_IMAGE": base_tag}, target="cpu", pull=False,
                                                    rm=True, forcerm=True, timeout=900)
        except docker.errors.BuildError as exc:
            text = "".join(str(chunk.get("stream", chunk.get("error", ""))) for chunk in exc.build_log)
            if re.search(r"Could not find a version|Network is unreachable|Temporary failure in name resolution"
                         r"|Could not fetch URL|No matching distribution", text):
                pytest.skip("no package index answers inside a build here: " + text.strip().splitlines()[-1][:200])
            raise
        text = "".join(str(chunk.get("stream", "")) for chunk in log)
        assert not re.search(r"^wheelhouse: the one docker/offline-prepare.sh made", text, re.M)  # its echo
        assert re.search(r"Saved \S*numpy-[\d.]+-cp311-cp311-manylinux\S*\.whl", text), text[-3000:]
        out = docker_client.containers.run(
            tag, ["sh", "-c", "id -u && distlib --help | head -n 1 && python -c 'import distlib, numpy; "
                              "print(distlib.__file__)'"],
            remove=True, network_mode="none", labels=labelled()).decode().split()
        assert out[0] == "1000" and out[1] == "usage:" and out[-1].startswith(f"{VENV}/lib/python3.11/site-packages/")
        assert built.attrs["Config"]["User"] == "1000:1000"
    finally:
        _remove_built_on(docker_client, base_tag)
        for ref in (tag, base_tag):
            if _exists(docker_client, ref):
                docker_client.images.remove(ref, force=True)
