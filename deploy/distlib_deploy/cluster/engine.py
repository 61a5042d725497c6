"""The Docker engine and Compose, as the cluster driver (and the container tests) use them.

Containers, their exit codes, logs and files go through the docker SDK (the ``docker``
package, the ``cluster`` extra): structured answers, no parsing of CLI output and no shell
pipelines. The cluster itself is still Compose's: ``docker compose`` (v2) or
``docker-compose`` (v1.29), run as a command, because the Compose files are what a user can
also run by hand.
"""

from __future__ import annotations

import contextlib
import io
import os
import shlex
import shutil
import subprocess
import tarfile
import threading
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence

from distlib.command import ToolError

#: Seconds a single Docker API call may take (an image build or a job has its own limits).
API_TIMEOUT_S = 120
#: Seconds `compose version` may take to answer while looking for Compose.
COMPOSE_PROBE_S = 30
DEMO_HINT = "`make demo` (a master service and 4 local processes, without Docker)"


def connect(timeout: float = API_TIMEOUT_S):
    """A docker SDK client for the engine at DOCKER_HOST (or the default socket), checked with
    a ping. ToolError, in one line, when the SDK is missing or no engine answers."""
    try:
        import docker
    except ImportError as exc:
        raise ToolError(f"the docker SDK for Python is not installed ({exc}): pip install 'distlib-c10d[cluster]' "
                        "(make cluster-up installs it)") from None
    try:
        client = docker.from_env(timeout=timeout)
        client.ping()
    except Exception as exc:  # DockerException, connection errors, permission denied ...
        reason = " ".join(str(exc).split()) or type(exc).__name__
        where = os.environ.get("DOCKER_HOST") or "the default socket"
        raise ToolError(f"the Docker engine is not reachable at {where} ({reason}); start it, or run "
                        f"{DEMO_HINT}") from None
    return client


# -- Compose ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Compose:
    """A Compose command (``docker compose`` or ``docker-compose`` ...) and its version."""

    argv: Sequence[str]
    version: str

    @property
    def text(self) -> str:
        return " ".join(self.argv)


def compose_version(argv: Sequence[str]) -> Optional[str]:
    """The version a Compose command reports (``2.40.3``, ``1.29.2``), or None if it is not one."""
    if not argv or shutil.which(argv[0]) is None:
        return None
    try:
        proc = subprocess.run([*argv, "version", "--short"], capture_output=True, text=True,
                              timeout=COMPOSE_PROBE_S, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return None
    out = proc.stdout.strip().lstrip("v")
    return out if proc.returncode == 0 and out[:1].isdigit() else None


def find_compose(wanted: Optional[str] = None) -> Compose:
    """``wanted`` (a command line, e.g. ``docker compose``), else ``docker compose``, else
    ``docker-compose``; ToolError naming what was tried when none answers."""
    candidates = [shlex.split(wanted)] if wanted else [["docker", "compose"], ["docker-compose"]]
    for argv in candidates:
        version = compose_version(argv)
        if version:
            return Compose(tuple(argv), version)
    if wanted:
        raise ToolError(f"COMPOSE={wanted!r} does not answer `{wanted} version` as Compose does")
    raise ToolError("neither `docker compose` (Compose v2) nor `docker-compose` is installed; install one "
                    f"(e.g. apt-get install docker-compose), or run {DEMO_HINT}")


def run_compose(compose: Compose, project: str, files: Sequence[str], args: Sequence[str],
                env: Mapping[str, str], log_path: Optional[str] = None,
                timeout: Optional[float] = None) -> subprocess.CompletedProcess:
    """``<compose> -p PROJECT -f FILE... ARGS`` with ``env``; output to ``log_path``, else
    inherited. Returns the completed process; its status is the caller's to read."""
    argv = [*compose.argv, "-p", project]
    for path in files:
        argv += ["-f", path]
    argv += list(args)
    try:
        if log_path:
            with open(log_path, "w") as log:
                return subprocess.run(argv, env=dict(env), stdout=log, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, timeout=timeout, text=True)
        return subprocess.run(argv, env=dict(env), stdin=subprocess.DEVNULL, timeout=timeout, text=True)
    except subprocess.TimeoutExpired:
        raise ToolError(f"`{compose.text} {' '.join(args)}` for {project} ran past {timeout:.0f} s") from None


# -- containers ---------------------------------------------------------------------------------


def project_containers(client, project: str, service: Optional[str] = None) -> List[Any]:
    """The containers of a Compose project (of one service), by Compose's labels, in a stable
    order (the replica number)."""
    labels = [f"com.docker.compose.project={project}"]
    if service:
        labels.append(f"com.docker.compose.service={service}")
    found = client.containers.list(all=True, filters={"label": labels})
    return sorted(found, key=lambda c: (c.labels.get("com.docker.compose.service", ""),
                                        int(c.labels.get("com.docker.compose.container-number", "0") or 0),
                                        c.name))


def short_name(container) -> str:
    """``worker-3``: the service and the replica number, the same under Compose v1 and v2."""
    labels = container.labels
    service = labels.get("com.docker.compose.service")
    number = labels.get("com.docker.compose.container-number")
    return f"{service}-{number}" if service and number else container.name


def logs_text(container) -> str:
    """All a container wrote (stdout and stderr, interleaved as written), as text."""
    return container.logs(stdout=True, stderr=True).decode("utf-8", "replace")


def read_file(container, path: str) -> Optional[bytes]:
    """The bytes of one file in a container (running or stopped: ``docker cp``'s API); None
    when it has no such file."""
    import docker

    try:
        stream, _stat = container.get_archive(path)
    except docker.errors.NotFound:
        return None
    with tarfile.open(fileobj=io.BytesIO(b"".join(stream))) as tar:
        member = next((m for m in tar.getmembers() if m.isfile()), None)
        if member is None:
            return None
        handle = tar.extractfile(member)
        return handle.read() if handle else None


def read_dir(container, path: str) -> Dict[str, bytes]:
    """The regular files of one directory in a container (running or stopped), by name; {}
    when it has no such directory."""
    import docker

    try:
        stream, _stat = container.get_archive(path)
    except docker.errors.NotFound:
        return {}
    out: Dict[str, bytes] = {}
    with tarfile.open(fileobj=io.BytesIO(b"".join(stream))) as tar:
        for member in tar.getmembers():
            handle = tar.extractfile(member) if member.isfile() else None
            if handle is not None:
                out[member.name.rsplit("/", 1)[-1]] = handle.read()
    return out


class LogFollower:
    """Follow the logs of some containers, each in a thread, calling ``emit(container, line)``
    per line, until ``stop()`` or until every stream ends (the containers stopped)."""

    def __init__(self, containers: Iterable[Any], emit: Callable[[Any, str], None]):
        self._emit = emit
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._streams: List[Any] = []
        self._threads = [threading.Thread(target=self._follow, args=(c,), daemon=True, name=f"logs-{c.name}")
                         for c in containers]
        for thread in self._threads:
            thread.start()

    def _follow(self, container) -> None:
        try:
            stream = container.logs(stdout=True, stderr=True, stream=True, follow=True)
        except Exception:  # noqa: BLE001 - a container removed meanwhile: nothing to follow
            return
        self._streams.append(stream)
        pending = b""
        try:
            for chunk in stream:
                if self._stopped.is_set():
                    break
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    with self._lock:
                        self._emit(container, line.decode("utf-8", "replace"))
        except Exception:  # noqa: BLE001 - the stream was closed by stop(), or the engine went away
            pass
        if pending and not self._stopped.is_set():
            with self._lock:
                self._emit(container, pending.decode("utf-8", "replace"))

    def running(self) -> bool:
        return any(t.is_alive() for t in self._threads)

    def join(self, timeout: float) -> None:
        for thread in self._threads:
            thread.join(timeout)

    def stop(self, grace: float = 0.5) -> None:
        """Let the last lines arrive for ``grace`` seconds, then close the streams."""
        self.join(grace)
        self._stopped.set()
        for stream in self._streams:
            with contextlib.suppress(Exception):
                stream.close()
        self.join(2.0)


# -- removing -----------------------------------------------------------------------------------


def remove_network(network) -> Optional[str]:
    """Disconnect what is still attached, then remove the network; None, or why it stayed."""
    import docker

    with contextlib.suppress(docker.errors.NotFound):
        network.reload()
        for container in network.containers:
            with contextlib.suppress(docker.errors.APIError):
                network.disconnect(container, force=True)
    try:
        network.remove()
    except docker.errors.NotFound:
        return None
    except docker.errors.APIError as exc:
        why = exc.explanation or str(exc)
        if "active endpoints" in why:
            why += (" (no container uses it: a network endpoint leaked inside the Docker engine; restarting "
                    "the engine clears it)")
        return f"could not remove network {network.name}: {why}"
    return None


def remove_by_label(client, label: str) -> List[str]:
    """Remove the containers (with their anonymous volumes), then the networks, then the
    volumes that carry ``label`` (``key=value``); what could not be removed, one line each."""
    import docker

    problems: List[str] = []
    for container in client.containers.list(all=True, filters={"label": label}):
        try:
            container.remove(force=True, v=True)
        except docker.errors.NotFound:
            pass
        except docker.errors.APIError as exc:
            problems.append(f"could not remove container {container.name}: {exc.explanation or exc}")
    for network in client.networks.list(filters={"label": label}):
        problem = remove_network(network)
        if problem:
            problems.append(problem)
    for volume in client.volumes.list(filters={"label": label}):
        try:
            volume.remove(force=True)
        except docker.errors.NotFound:
            pass
        except docker.errors.APIError as exc:
            problems.append(f"could not remove volume {volume.name}: {exc.explanation or exc}")
    return problems


def labelled(client, label: str) -> Dict[str, List[str]]:
    """Names of the containers, networks and volumes that carry ``label``."""
    return {
        "containers": [c.name for c in client.containers.list(all=True, filters={"label": label})],
        "networks": [n.name for n in client.networks.list(filters={"label": label})],
        "volumes": [v.name for v in client.volumes.list(filters={"label": label})],
    }
