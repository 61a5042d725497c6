"""Real NFS hosts for the FileStore tests: Linux NFS clients in VMs, two kinds of server.

``NfsHosts`` (built by ``start()``) holds:

* ``clients``: client VMs (vm.py), each with every mount of ``mounts``;
* ``server``: a VM running the kernel NFS server (knfsd) on the VMs' LAN, exporting /export
  as NFSv4.2 and NFSv3 with lockd and rpc.statd (the v3 locking users run); its lease and
  grace periods are LEASE_S (Linux's default, 90 s, would make every restart test wait 90 s);
* ``ganesha``: the NFS server container of the Compose cluster's ``MODE=nfs`` (nfs-ganesha,
  compose/nfs/, started from the same Compose files and settings `distlib cluster up` uses),
  published on the host's 127.0.0.1, which the guests reach as 10.0.2.2 over QEMU's user
  network: the server side users deploy with ``MODE=nfs`` is the one tested.

Mounts, the same path in every client (``NfsMount``):

=====================  ===========================================================  =========
name                   what                                                          locks
=====================  ===========================================================  =========
``nfs4.2``             srv:/export, vers=4.2 (kernel server)                         NFSv4
``nfs3``               srv:/export, vers=3,proto=tcp (kernel server)                 NLM (lockd)
``ganesha-nfs4.1``     10.0.2.2:/export, vers=4.1,port=P (the cluster's container)   NFSv4
``nfs3-nolock``        srv:/export, vers=3,nolock: what FileStore must refuse        local only
=====================  ===========================================================  =========
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Sequence, TypeVar

from tests.support.vm import REPO_ROOT, VM, Fleet, Image, VMError

T = TypeVar("T")

#: The kernel server's lease and grace periods. 10 s once left a client VM unable to recover
#: from a server restart for 3 minutes in CI (its renewals, every 2/3 of the lease, run late
#: when five emulated VMs share 2 loaded cores); 20 s leaves it room and costs 10 s a restart.
LEASE_S = 20
GUEST = "/opt/src/tests/platforms/guest"
GUEST_NFS = f"{GUEST}/nfs.sh"
COMPOSE_PROJECT_PREFIX = "distlib-nfsvm-"


@dataclass(frozen=True)
class NfsMount:
    """One NFS mount, at ``path`` in every client."""

    name: str
    source: str
    path: str
    options: str
    #: who serves it, as an error should name it
    server: str


class Ganesha:
    """The cluster's NFS server container (MODE=nfs's ``nfs`` service), alone, on 127.0.0.1:port."""

    def __init__(self, image: str, port: int):
        from distlib_deploy.cluster import engine
        from distlib_deploy.cluster.config import Settings

        self.port = port
        self.project = f"{COMPOSE_PROJECT_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:6]}"
        env = {"MODE": "nfs", "NODES": "1", "AUTH": "0", "IMAGE": image, "NFS_HOST_PORT": str(port),
               "CLUSTER_STATE_DIR": str(REPO_ROOT / ".build" / "nfs-vm-cluster")}
        self.settings = Settings.from_env(REPO_ROOT, env)
        self.compose = engine.find_compose()
        self.files = self.settings.compose_files()
        self.variables = {**os.environ, **self.settings.compose_variables(self.project[len("distlib-"):])}
        self.log = REPO_ROOT / ".build" / f"{self.project}.log"

    def _compose(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        from distlib_deploy.cluster import engine

        return engine.run_compose(self.compose, self.project, self.files, list(args), self.variables,
                                  log_path=str(self.log), timeout=timeout)

    def build_image(self) -> None:
        """compose/nfs/build-nfs-image.sh, as `distlib cluster up` runs it for MODE=nfs."""
        env = {**os.environ, "IMAGE": self.settings.image}
        done = subprocess.run(["bash", str(REPO_ROOT / "compose" / "nfs" / "build-nfs-image.sh")], env=env,
                              capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL)
        if done.returncode != 0:
            raise VMError(f"building the NFS server image failed:\n{done.stderr[-2000:]}")

    def up(self) -> None:
        """The ``nfs`` service up and healthy (its own healthcheck: nfs-ls of the export)."""
        done = self._compose("up", "-d", "nfs")
        if done.returncode != 0:
            raise VMError(f"starting the cluster's nfs service failed: {self.log.read_text()[-2000:]}")
        self.wait_healthy(120)

    def container(self):
        from distlib_deploy.cluster import engine

        client = engine.connect()
        found = engine.project_containers(client, self.project, "nfs")
        if not found:
            raise VMError(f"no nfs container in project {self.project}")
        return found[0]

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            container = self.container()
            health = container.attrs["State"].get("Health", {}).get("Status")
            if health == "healthy":
                return
            if time.monotonic() > deadline:
                raise VMError(f"the nfs container of {self.project} is {health} after {timeout:.0f} s")
            time.sleep(0.5)

    def restart(self, down_s: float) -> None:
        """Stop the server (its clients' state goes with it), wait ``down_s``, start it again."""
        container = self.container()
        container.stop(timeout=5)
        time.sleep(down_s)
        container.start()

    def down(self) -> None:
        self._compose("down", "-v", "--remove-orphans", "-t", "2", timeout=120)

    @staticmethod
    def sweep_orphans() -> List[str]:
        """Remove the nfs projects of test sessions whose process is gone."""
        from distlib_deploy.cluster import engine

        removed = []
        with contextlib.suppress(Exception):
            client = engine.connect()
            for c in client.containers.list(all=True, filters={"label": "com.docker.compose.project"}):
                project = c.labels.get("com.docker.compose.project", "")
                if not project.startswith(COMPOSE_PROJECT_PREFIX):
                    continue
                pid = project[len(COMPOSE_PROJECT_PREFIX):].split("-")[0]
                if pid.isdigit() and not Path(f"/proc/{pid}").exists():
                    c.remove(force=True, v=True)
                    removed.append(c.name)
            for v in client.volumes.list(filters={"label": "org.distlib.cluster=1"}):
                project = (v.attrs.get("Labels") or {}).get("com.docker.compose.project", "")
                pid = project[len(COMPOSE_PROJECT_PREFIX):].split("-")[0] if project.startswith(
                    COMPOSE_PROJECT_PREFIX) else ""
                if pid.isdigit() and not Path(f"/proc/{pid}").exists():
                    with contextlib.suppress(Exception):
                        v.remove(force=True)
        return removed


@dataclass
class NfsHosts:
    """Client VMs with their NFS mounts, the kernel server VM and the cluster's ganesha."""

    fleet: Fleet
    server: VM
    clients: List[VM]
    mounts: Dict[str, NfsMount]
    ganesha: Optional[Ganesha]
    #: booted and mounted like the clients, for tests that power a host off
    spares: List[VM] = field(default_factory=list)

    def mount(self, vm: VM, names: Optional[Sequence[str]] = None, timeout: float = 120) -> None:
        """Mount ``names`` (default: all) in ``vm``, after rpcbind and rpc.statd."""
        vm.run(["/bin/sh", GUEST_NFS, "client-start"], timeout=timeout).check()
        for name in names or list(self.mounts):
            m = self.mounts[name]
            vm.run(["/bin/sh", GUEST_NFS, "mount", m.source, m.path, m.options], timeout=timeout).check()

    def new_dir(self, mount: str, hint: str = "t") -> str:
        """A new empty directory (mode 1777) on ``mount``, made through the first client."""
        path = f"{self.mounts[mount].path}/{hint}-{uuid.uuid4().hex[:8]}"
        self.clients[0].run(["mkdir", "-m", "1777", path], timeout=60).check()
        return path

    def spare(self) -> VM:
        """A spare client for a test that powers it off (one per session: ask for more with
        ``start(spares=N)``)."""
        for vm in self.spares:
            if vm.alive():
                return vm
        raise VMError("no spare client VM left (start(spares=N) boots more)")


def script(vm: VM, name: str, args: Sequence[str], timeout: float,
           env: Optional[Dict[str, str]] = None) -> dict:
    """Run guest/<name> in ``vm``; its JSON line (the last line of its stdout) as a dict, with the
    VM's name and the script's stderr added. VMError when it printed no JSON."""
    result = vm.run(["python3", f"{GUEST}/{name}", *args], timeout=timeout, env=env)
    lines = [line for line in result.out.splitlines() if line.startswith("{")]
    if not lines:
        raise VMError(f"{vm.name}: {name} {' '.join(args)} printed no result (exit {result.rc}, timed out "
                      f"{result.timed_out})\n--- stdout\n{result.out[-2000:]}\n--- stderr\n{result.err[-3000:]}")
    out = json.loads(lines[-1])
    out["vm"], out["stderr"] = vm.name, result.err
    return out


def spawn_script(vm: VM, name: str, args: Sequence[str], env: Optional[Dict[str, str]] = None) -> str:
    """Start guest/<name> in the background of ``vm`` (for a step whose process may not be able
    to exit: blocked on a server that is down); ``spawned_result`` reads what it printed."""
    label = f"{Path(name).stem}-{uuid.uuid4().hex[:6]}"
    vm.spawn(["python3", f"{GUEST}/{name}", *args], label, env)
    return label


def spawned_result(vm: VM, label: str, timeout: float) -> dict:
    """The JSON line of a spawned script, once it has printed it (VMError after ``timeout``)."""
    wait = vm.sh(f"i=0; until grep -q '^{{' /tmp/{label}.out 2>/dev/null; do i=$((i+1)); "
                 f"[ $i -gt {int(timeout * 10)} ] && exit 1; sleep 0.1; done; cat /tmp/{label}.out",
                 timeout=timeout + 10)
    err = vm.sh(f"cat /tmp/{label}.err", timeout=30).out
    if wait.rc != 0:
        raise VMError(f"{vm.name}: {label} printed no result within {timeout:.0f} s\n--- stderr\n{err[-3000:]}")
    out = json.loads([line for line in wait.out.splitlines() if line.startswith("{")][-1])
    out["vm"], out["stderr"] = vm.name, err
    return out


def wait_for_marker(vm: VM, path: str, timeout: float) -> None:
    """Wait until ``path`` exists on ``vm``'s own disk (a step's marker)."""
    vm.sh(f"i=0; while [ ! -e {path} ]; do i=$((i+1)); [ $i -gt {int(timeout * 10)} ] && exit 1; sleep 0.1; done",
          timeout=timeout + 10).check()


def in_grace(server: VM) -> bool:
    """Whether the kernel server is in its grace period (``/proc/fs/nfsd/v4_end_grace`` reads N
    until the period is over: its length, or up to twice it while clients still reclaim)."""
    answer = server.sh("cat /proc/fs/nfsd/v4_end_grace", timeout=30).check().out.strip()
    assert answer in ("Y", "N"), f"{server.name}: v4_end_grace says {answer!r}"
    return answer == "N"


def wait_grace_over(server: VM, timeout: float) -> None:
    """Wait until the kernel server's grace period is over."""
    deadline = time.monotonic() + timeout
    while in_grace(server):
        if time.monotonic() > deadline:
            raise VMError(f"{server.name}: still in its grace period after {timeout:.0f} s")
        time.sleep(1)


def side_by_side(*calls: Callable[[], T]) -> List[T]:
    """Run the calls in threads at once; their results in order (the first error is raised)."""
    with ThreadPoolExecutor(max_workers=len(calls)) as pool:
        futures = [pool.submit(call) for call in calls]
        return [f.result() for f in futures]


@contextlib.contextmanager
def start(image: Image, clients: int = 3, spares: int = 0,
          ganesha_image: Optional[str] = None) -> Iterator[NfsHosts]:
    """The whole set: the kernel server VM and ``clients`` client VMs (booted side by side), the
    cluster's ganesha container when ``ganesha_image`` (the distlib image its base comes from)
    is given, every mount in every client. Everything is removed on exit."""
    ganesha = None
    with contextlib.ExitStack() as stack:
        if ganesha_image:
            Ganesha.sweep_orphans()
            from tests.support.vm import _free_port

            ganesha = Ganesha(ganesha_image, _free_port())
            ganesha.build_image()
            stack.callback(ganesha.down)
            ganesha.up()
        fleet = stack.enter_context(Fleet(image))
        names = ["srv"] + [f"c{i + 1}" for i in range(clients)] + [f"spare{i + 1}" for i in range(spares)]
        vms = fleet.boot(names)
        server, client_vms, spare_vms = vms[0], vms[1:1 + clients], vms[1 + clients:]
        server.run(["/bin/sh", GUEST_NFS, "server-start", str(LEASE_S)], timeout=120).check()
        mounts = {
            "nfs4.2": NfsMount("nfs4.2", "srv:/export", "/mnt/nfs4.2", "vers=4.2", "srv:/export"),
            "nfs3": NfsMount("nfs3", "srv:/export", "/mnt/nfs3", "vers=3,proto=tcp", "srv:/export"),
            "nfs3-nolock": NfsMount("nfs3-nolock", "srv:/export", "/mnt/nfs3-nolock",
                                    "vers=3,proto=tcp,nolock,nosharecache", "srv:/export"),
        }
        if ganesha:
            mounts["ganesha-nfs4.1"] = NfsMount("ganesha-nfs4.1", "10.0.2.2:/export", "/mnt/ganesha",
                                                f"vers=4.1,port={ganesha.port}", "10.0.2.2:/export")
        hosts = NfsHosts(fleet, server, client_vms, mounts, ganesha, spare_vms)
        with ThreadPoolExecutor(max_workers=len(client_vms + spare_vms)) as pool:
            for f in [pool.submit(hosts.mount, vm) for vm in client_vms + spare_vms]:
                f.result()
        yield hosts
