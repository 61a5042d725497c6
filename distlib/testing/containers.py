"""The container substrate: each host a container (docker SDK), on a private network.

Every host gets its own name and a fixed address on an internal network of its own (no route
out), the cluster's hosts file as /etc/hosts, the user's directory and the run directory at
the same paths as on this machine, and a small shared tmpfs volume for FileStores. Faults act
from outside, so the user's image needs no capability: kill and pause through the engine,
signals and the shared directory through ``docker exec``, network faults with iptables (and tc)
run by ``nsenter`` in the container's network namespace, on the engine's host (a local engine,
root or passwordless sudo: GitHub's runners). The master service runs in a container of the
same image, with this harness's own distlib mounted, so its observer speaks this harness's
protocol whatever distlib the image has.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import random
import shutil
import socket
import threading
import time
from typing import Any, Dict, FrozenSet, List, Mapping, Optional, Sequence, Tuple

from . import privilege
from .netfaults import HostLink, netem_missing
from .substrate import LineSink

DEFAULT_IMAGE = "distlib:cpu"
API_TIMEOUT_S = 120
LABEL = "distlib.testing"
#: where the harness's sitecustomize and its own distlib (for the master) appear in a container
SITE_IN_CONTAINER = "/opt/distlib-testing/site"
LIB_IN_CONTAINER = "/opt/distlib-testing/lib"
SHARED_MB = 64
SITE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_site")
PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # .../distlib


class DockerUnavailable(Exception):
    """No engine answers, the SDK is missing, or the image is absent (the message says which)."""


def connect(timeout: float = API_TIMEOUT_S) -> Any:
    try:
        import docker
    except ImportError as exc:
        raise DockerUnavailable(f"the docker SDK is not installed ({exc}): pip install 'distlib-c10d[testing]'") \
            from None
    try:
        client = docker.from_env(timeout=timeout)
        client.ping()
    except Exception as exc:  # noqa: BLE001 - DockerException, connection refused, permission denied
        where = os.environ.get("DOCKER_HOST") or "the default socket"
        raise DockerUnavailable(f"no Docker engine reachable at {where}: {' '.join(str(exc).split())[:300]}") \
            from None
    return client


def _labels(extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    return {LABEL: "1", f"{LABEL}.pid": str(os.getpid()), f"{LABEL}.host": socket.gethostname(), **(extra or {})}


def sweep(client: Any) -> List[str]:
    """Remove the containers, networks and volumes of harnesses on this machine that are gone."""
    removed = []

    def orphan(labels: Optional[Dict[str, str]]) -> bool:
        labels = labels or {}
        if labels.get(f"{LABEL}.host") != socket.gethostname():
            return False
        try:
            return not privilege.pid_alive(int(labels.get(f"{LABEL}.pid", "")))
        except ValueError:
            return False

    for c in client.containers.list(all=True, filters={"label": f"{LABEL}=1"}):
        if orphan(c.labels):
            with contextlib.suppress(Exception):
                c.remove(force=True)
                removed.append(f"container {c.name}")
    for n in client.networks.list(filters={"label": f"{LABEL}=1"}):
        if orphan(n.attrs.get("Labels")):
            with contextlib.suppress(Exception):
                n.remove()
                removed.append(f"network {n.name}")
    for v in client.volumes.list(filters={"label": f"{LABEL}=1"}):
        if orphan(v.attrs.get("Labels")):
            with contextlib.suppress(Exception):
                v.remove(force=True)
                removed.append(f"volume {v.name}")
    return removed


class ContainerHost:
    """One host: a container made at its first start, started again for a restart."""

    def __init__(self, sub: "ContainerSubstrate", name: str, address: str):
        self.sub = sub
        self.name = name
        self.address = address
        self.container: Any = None
        self._status: Optional[int] = None
        self._running = False
        self._lock = threading.Lock()
        self._link: Optional[HostLink] = None

    # --- start --------------------------------------------------------------------------------

    def start(self, argv: Sequence[str], env: Mapping[str, str], cwd: str, on_line: LineSink) -> None:
        api = self.sub.client.api
        if self.container is None:
            self.container = self._create(argv, env, cwd)
        since = time.time()
        with self._lock:
            self._status, self._running = None, True
        api.start(self.container)
        threading.Thread(target=self._follow, args=(on_line, since), name=f"distlib-testing-{self.name}-logs",
                         daemon=True).start()
        threading.Thread(target=self._wait, name=f"distlib-testing-{self.name}-wait", daemon=True).start()

    def _create(self, argv: Sequence[str], env: Mapping[str, str], cwd: str) -> str:
        sub, api = self.sub, self.sub.client.api
        binds = {
            sub.run_dir: {"bind": sub.run_dir, "mode": "rw"},
            sub.project_dir: {"bind": sub.project_dir, "mode": "rw"},
            SITE_DIR: {"bind": SITE_IN_CONTAINER, "mode": "ro"},
            sub.hosts_file: {"bind": "/etc/hosts", "mode": "ro"},
            os.path.join(sub.run_dir, "resolv.conf"): {"bind": "/etc/resolv.conf", "mode": "ro"},
        }
        if self.name == "master":
            binds[PACKAGE_DIR] = {"bind": f"{LIB_IN_CONTAINER}/distlib", "mode": "ro"}
        from docker.types import Mount

        host_config = api.create_host_config(
            binds=binds, mounts=[Mount(sub.shared, sub.volume, type="volume")], init=True)
        networking = api.create_networking_config({sub.network: api.create_endpoint_config(ipv4_address=self.address)})
        created = api.create_container(
            sub.image, command=list(argv), hostname=self.name, environment=dict(env), working_dir=cwd,
            name=f"{sub.prefix}-{self.name}", labels=_labels({f"{LABEL}.cluster": sub.prefix}),
            host_config=host_config, networking_config=networking, user=sub.user, detach=True)
        return created["Id"]

    def _follow(self, on_line: LineSink, since: float) -> None:
        pending = b""
        with contextlib.suppress(Exception):
            for chunk in self.sub.client.api.logs(self.container, stream=True, follow=True, stdout=True,
                                                  stderr=True, since=since - 0.001):
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    on_line(self.name, "output", line.decode("utf-8", "replace"))
        if pending:
            on_line(self.name, "output", pending.decode("utf-8", "replace"))

    def _wait(self) -> None:
        try:
            code = int(self.sub.client.api.wait(self.container, timeout=None)["StatusCode"])
        except Exception:  # noqa: BLE001 - the container was removed under us: it ended
            code = 137
        with self._lock:
            self._status, self._running = (-(code - 128) if code > 128 else code), False

    # --- state and actions --------------------------------------------------------------------

    def poll(self) -> Optional[int]:
        with self._lock:
            return None if self._running else self._status

    def kill(self) -> str:
        with contextlib.suppress(Exception):
            self.sub.client.api.kill(self.container)
        return f"docker kill {self.name} (SIGKILL to every process in it)"

    def pause(self) -> str:
        self.sub.client.api.pause(self.container)
        return f"docker pause {self.name} (its cgroup frozen)"

    def resume(self) -> str:
        with contextlib.suppress(Exception):
            self.sub.client.api.unpause(self.container)
        return f"docker unpause {self.name}"

    def signal_pid(self, pid: int, signum: int) -> bool:
        if self.container is None or self.poll() is not None:
            return False
        api = self.sub.client.api
        try:
            exec_id = api.exec_create(self.container, ["sh", "-c", f"kill -{int(signum)} {int(pid)}"], user="root")
            api.exec_start(exec_id)
            return api.exec_inspect(exec_id).get("ExitCode") == 0
        except Exception:  # noqa: BLE001 - a container that stopped in between
            return False

    def host_pid(self) -> int:
        return int(self.sub.client.api.inspect_container(self.container)["State"]["Pid"])

    def link(self) -> HostLink:
        why = self.sub.missing.get("network")
        if why:
            raise RuntimeError(why)
        if self._link is None:
            def run(argv: List[str], input_text: Optional[str] = None) -> Tuple[int, str]:
                return privilege.run(["nsenter", "-t", str(self.host_pid()), "-n", *argv], check=False,
                                     input_text=input_text)

            self._link = HostLink(self.name, run)
        return self._link

    def release(self) -> None:
        if self.container is not None:
            with contextlib.suppress(Exception):
                self.sub.client.api.remove_container(self.container, force=True)
            self.container = None
            self._link = None


class ContainerSubstrate:
    kind = "containers"

    def __init__(self, run_dir: str, project_dir: str, image: Optional[str] = None, client: Any = None,
                 user: Optional[str] = None):
        self.client = client or connect()
        self.image = image or DEFAULT_IMAGE
        try:
            self.client.images.get(self.image)
        except Exception as exc:  # noqa: BLE001 - ImageNotFound, or the engine's error
            raise DockerUnavailable(f"image {self.image} is not on this Docker engine ({type(exc).__name__}); "
                                    f"build it (distlib:cpu: make image) or choose one with --distlib-image; "
                                    f"the harness never pulls") from None
        sweep(self.client)
        self.run_dir = os.path.abspath(run_dir)
        self.project_dir = os.path.abspath(project_dir)
        self.hosts_file = os.path.join(self.run_dir, "hosts")
        open(self.hosts_file, "a").close()
        self.shared = os.path.join(self.run_dir, "shared")
        os.makedirs(self.shared, exist_ok=True)
        self.user = user if user is not None else f"{os.getuid()}:{os.getgid()}"
        self.prefix = f"dlt-{os.getpid()}-{os.path.basename(self.run_dir)[-8:].lower().strip('_-') or 'c'}"
        self.hosts: Dict[str, ContainerHost] = {}
        self.network, self.subnet = self._make_network()
        self.volume = self.client.volumes.create(
            name=f"{self.prefix}-shared", driver="local", labels=_labels(),
            driver_opts={"type": "tmpfs", "device": "tmpfs", "o": f"size={SHARED_MB}m,mode=1777"}).name
        self.keeper = self._start_keeper()
        self.missing: Dict[str, str] = {}
        abilities = {"signals", "master", "names", "disk"}
        why = self._why_no_host_side()
        if why:
            self.missing["network"] = self.missing["netem"] = self.missing["readonly"] = why
        else:
            abilities |= {"network", "readonly"}
            netem = netem_missing()
            if netem is None:
                abilities.add("netem")
            else:
                self.missing["netem"] = netem
        self.abilities: FrozenSet[str] = frozenset(abilities)

    def _start_keeper(self) -> str:
        """A container that only sleeps with the shared volume mounted, for the cluster's life:
        the engine unmounts a tmpfs volume (and loses its files) when no container uses it, and
        a stale FileStore left by one run must still be there for the next; disk faults act
        through it, whichever hosts are down."""
        from docker.types import Mount

        api = self.client.api
        created = api.create_container(
            self.image, command=["sleep", "infinity"], name=f"{self.prefix}-volume", labels=_labels(), user="root",
            host_config=api.create_host_config(mounts=[Mount(self.shared, self.volume, type="volume")], init=True,
                                               network_mode="none"))
        api.start(created["Id"])
        return created["Id"]

    def _make_network(self) -> Tuple[str, ipaddress.IPv4Network]:
        """An internal network with a subnet of its own (fixed addresses need one); another
        subnet is drawn when the engine says one overlaps."""
        from docker.types import IPAMConfig, IPAMPool

        rng = random.Random()
        last = ""
        for _ in range(20):
            subnet = ipaddress.IPv4Network(f"10.{rng.randint(128, 254)}.{rng.randint(0, 255)}.0/24")
            try:
                net = self.client.networks.create(
                    f"{self.prefix}-net", driver="bridge", internal=True, labels=_labels(),
                    ipam=IPAMConfig(pool_configs=[IPAMPool(subnet=str(subnet), gateway=str(subnet[1]))]))
                return str(net.name), subnet
            except Exception as exc:  # noqa: BLE001 - "Pool overlaps with other one on this address space"
                last = str(exc)
                if "overlap" not in last.lower():
                    raise
        raise RuntimeError(f"no free /24 for the cluster's network after 20 tries: {last}")

    def _why_no_host_side(self) -> Optional[str]:
        """None when the harness can act in a container's namespaces from the engine's host
        (network faults, a read-only remount), else why not."""
        base = str(getattr(self.client.api, "base_url", ""))
        if "localhost" not in base and "unix" not in base:
            return (f"this fault acts in a container's namespaces from the engine's host, and this engine is remote "
                    f"({base})")
        if privilege.why_not():
            return f"this fault acts from the engine's host and needs root there: {privilege.why_not()}"
        missing = [tool for tool in ("nsenter", "iptables-restore", "mount") if not shutil.which(tool)]
        if missing:
            return f"this fault acts from the engine's host and needs {', '.join(missing)} there"
        return None

    def interpreter(self) -> str:
        return "python3"

    def python_paths(self, host: str) -> List[str]:
        return [SITE_IN_CONTAINER] + ([LIB_IN_CONTAINER] if host == "master" else [])

    def make_hosts(self, names: List[str]) -> Dict[str, ContainerHost]:
        for host in self.hosts.values():
            host.release()
        made = {}
        for index, name in enumerate(names):
            number = name[4:] if name.startswith("node") else ""
            address = str(self.subnet[10 + int(number)] if number.isdigit() else self.subnet[2 + index])
            made[name] = ContainerHost(self, name, address)
        self.hosts = made
        return made

    def disk(self, state: str) -> str:
        """"full": a filler file up to ENOSPC, written by ``docker exec`` (as root, no capability)
        in the volume's keeper; "readonly": the volume's tmpfs remounted read-only from the
        engine's host, in the keeper's mount namespace (every container shares the superblock)."""
        pid = int(self.client.api.inspect_container(self.keeper)["State"]["Pid"])
        filler = os.path.join(self.shared, ".distlib-testing-filler")

        def remount(mode: str) -> None:
            privilege.run(["nsenter", "-t", str(pid), "-m", "mount", "-o", f"remount,{mode}", self.shared])

        if state == "readonly":
            remount("ro")
            return f"remounted {self.shared} read-only: writes now fail with EROFS"
        if state == "ok" and "readonly" in self.abilities:
            remount("rw")
        script = f'cat /dev/zero > "{filler}" 2>/dev/null; true' if state == "full" else f'rm -f "{filler}"'
        api = self.client.api
        exec_id = api.exec_create(self.keeper, ["sh", "-c", script], user="root")
        out = api.exec_start(exec_id)
        code = api.exec_inspect(exec_id).get("ExitCode")
        if code != 0:
            raise RuntimeError(f"shared volume {state}: exit {code}: {out.decode(errors='replace')[-300:]}")
        return (f"filled {self.shared} (tmpfs volume, {SHARED_MB} MiB): writes now fail with ENOSPC" if state == "full"
                else f"{self.shared} writable again")

    def close(self) -> None:
        for host in self.hosts.values():
            host.release()
        with contextlib.suppress(Exception):
            self.client.api.remove_container(self.keeper, force=True)
        with contextlib.suppress(Exception):
            self.client.networks.get(self.network).remove()
        with contextlib.suppress(Exception):
            self.client.volumes.get(self.volume).remove(force=True)
        with contextlib.suppress(Exception):
            self.client.close()
