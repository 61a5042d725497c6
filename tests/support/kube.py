"""A real Kubernetes 1.20 control plane and kubelet on this machine, for the chart's tests.

``start()`` runs etcd, kube-apiserver, kube-controller-manager, kube-scheduler and one kubelet
(dockershim: pods are containers of this Docker engine), all listening on 127.0.0.1 only; no
kube-proxy (a Service's virtual IP leads nowhere here). The binaries come from
tests/platforms/build-kube.sh (Debian's source package, built once and cached under
``settings.cache_dir()``/kube-1.20). The two things 1.20 and this machine lack are stood in for
by ``kube_stand_ins.py``: the Indexed Job controller (kube-controller-manager runs with ``-job``) and the
cluster DNS the kubelet's ``--cluster-dns`` points pods at. docs/cluster.md says why and how.

``Api`` is a small client of the apiserver's REST API (urllib, the token of a system:masters
user, the test CA verified): what the tests and the stand-ins read and write.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import socket
import ssl
import struct
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.support import settings
from tests.fixtures import certs


REPO = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = REPO / "tests" / "platforms" / "build-kube.sh"
PAUSE_IMAGE = "distlib:kube-pause"
# The node's name is its Hostname address, which the apiserver dials for logs and exec: "localhost"
# resolves (to 127.0.0.1, where the kubelet listens) without any DNS. Its InternalIP is the
# Docker bridge's address (the kubelet refuses a loopback node IP).
NODE_NAME = "localhost"
CLUSTER_DOMAIN = "cluster.local"
# Every namespace the tests make starts with this: their pods' containers are found by it.
NAMESPACE_PREFIX = "helmkube-"


class KubeError(AssertionError):
    pass


class ApiError(KubeError):
    def __init__(self, method: str, path: str, status: int, body: str):
        self.status = status
        super().__init__(f"{method} {path}: HTTP {status}: {body[:400]}")


def build() -> Path:
    """The cached build's directory (bin/kube-*, bin/etcd, bin/pause); builds it the first time
    (7-11 minutes on 2 cores; the script's progress goes to stderr)."""
    env = dict(os.environ, DISTLIB_CACHE=settings.cache_dir())
    proc = subprocess.run(["bash", str(BUILD_SCRIPT)], env=env, stdout=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise KubeError(f"{BUILD_SCRIPT.name} failed (exit {proc.returncode}): see its messages above")
    return Path(proc.stdout.strip().splitlines()[-1])


def cached_build() -> Path | None:
    found = sorted(Path(settings.cache_dir(), "kube-1.20").glob("build-*/build.env"))
    return found[-1].parent if found else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Api:
    """The apiserver's REST API: JSON in and out, errors as ApiError naming the request."""

    def __init__(self, server: str, token: str, cafile: str):
        self.server = server
        self.token = token
        self._ctx = ssl.create_default_context(cafile=cafile)

    def request(self, method: str, path: str, body: Any = None, *, timeout: float = 30.0,
                content_type: str = "application/json", raw: bool = False) -> Any:
        data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
        req = urllib.request.Request(self.server + path, data=data, method=method)
        req.add_header("Authorization", f"Bearer {self.token}")
        if data is not None:
            req.add_header("Content-Type", content_type)
        try:
            with urllib.request.urlopen(req, context=self._ctx, timeout=timeout) as resp:
                text = resp.read().decode("utf-8", "replace")
        except urllib.error.HTTPError as e:
            raise ApiError(method, path, e.code, e.read().decode("utf-8", "replace")) from None
        return text if raw else (json.loads(text) if text else None)

    def get(self, path: str, **query: str) -> Any:
        q = f"?{urllib.parse.urlencode(query)}" if query else ""
        return self.request("GET", path + q)

    def items(self, path: str, **query: str) -> list[dict[str, Any]]:
        return list(self.get(path, **query).get("items") or [])

    def create(self, path: str, obj: dict[str, Any]) -> dict[str, Any]:
        return self.request("POST", path, obj)

    def delete(self, path: str, missing_ok: bool = True, **query: str) -> Any:
        q = f"?{urllib.parse.urlencode(query)}" if query else ""
        try:
            return self.request("DELETE", path + q)
        except ApiError as e:
            if e.status == 404 and missing_ok:
                return None
            raise

    def patch(self, path: str, obj: dict[str, Any]) -> dict[str, Any]:
        return self.request("PATCH", path, obj, content_type="application/merge-patch+json")

    def logs(self, namespace: str, pod: str, container: str, previous: bool = False) -> str:
        q = urllib.parse.urlencode({"container": container, "previous": "true" if previous else "false"})
        return str(self.request("GET", f"/api/v1/namespaces/{namespace}/pods/{pod}/log?{q}", raw=True))

    def wait(self, what: str, check: Any, timeout_s: float, poll_s: float = 0.25) -> Any:
        """Poll ``check()`` until it returns something true; the error names ``what`` and what
        ``check`` last said (its last result, or the error it raised)."""
        deadline = time.monotonic() + timeout_s
        last: Any = None
        while True:
            try:
                got = check()
                if got:
                    return got
                last = got
            except (OSError, ApiError) as e:
                last = e
            if time.monotonic() > deadline:
                raise KubeError(f"waited {timeout_s:.0f} s for {what}; last: {last!r}"[:2000])
            time.sleep(poll_s)


@dataclass
class Cluster:
    api: Api
    workdir: Path
    kubeconfig: Path
    dns_ip: str
    build_dir: Path
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def log_of(self, name: str, lines: int = 40) -> str:
        path = self.workdir / "logs" / f"{name}.log"
        try:
            return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return f"(no log at {path})"

    def check_alive(self) -> None:
        for name, proc in self.processes.items():
            if proc.poll() is not None:
                raise KubeError(f"{name} exited with {proc.returncode}; its log ends:\n{self.log_of(name)}")

    def namespace(self, name: str) -> str:
        assert name.startswith(NAMESPACE_PREFIX), name
        self.api.create("/api/v1/namespaces", {"metadata": {"name": name}})
        # the service account controller makes "default"; pods are refused until it exists
        self.api.wait(f"the service account default in {name}",
                      lambda: self.api.get(f"/api/v1/namespaces/{name}/serviceaccounts/default"), 30)
        return name

    def delete_namespace(self, name: str, timeout_s: float = 60.0) -> None:
        """Delete the namespace and wait until its pods are gone (the kubelet stopped them).

        A pod can stay behind in a terminating namespace with its container never created again
        (seen after a master pod's deletion: the terminating pod listed as Running, its
        container waiting in ContainerCreating): past half the time, what is left is deleted
        with no grace period, as an operator would, and the wait goes on."""
        pods = f"/api/v1/namespaces/{name}/pods"
        self.api.delete(f"/api/v1/namespaces/{name}")
        try:
            self.api.wait(f"the pods of namespace {name} to be gone", lambda: not self.api.items(pods), timeout_s / 2)
        except KubeError:
            for pod in self.api.items(pods):
                self.api.delete(f"{pods}/{pod['metadata']['name']}", gracePeriodSeconds="0")
            self.api.wait(f"the pods of namespace {name} to be gone after a forced deletion",
                          lambda: not self.api.items(pods), timeout_s / 2)


def _write_kubeconfig(path: Path, server: str, token: str, ca: str) -> None:
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "distlib",
        "clusters": [{"name": "distlib", "cluster": {"server": server, "certificate-authority": ca}}],
        "users": [{"name": "admin", "user": {"token": token}}],
        "contexts": [{"name": "distlib", "context": {"cluster": "distlib", "user": "admin"}}],
    }))
    path.chmod(0o600)


def _service_account_keys(directory: Path) -> tuple[str, str]:
    """An RSA key pair for the service-account tokens, in the PEM forms 1.20 reads ("RSA
    PRIVATE KEY", "PUBLIC KEY"; it does not parse PKCS#8 EC keys)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    priv, pub = directory / "sa.key", directory / "sa.pub"
    priv.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL,
                                       serialization.NoEncryption()))
    pub.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                  serialization.PublicFormat.SubjectPublicKeyInfo))
    return str(priv), str(pub)


def pause_image(docker_client: Any, build_dir: Path) -> str:
    """The pod sandbox's image: the tree's build/pause/linux/pause.c (static), FROM scratch."""
    import docker

    marker = (build_dir / "build.env").read_text()
    try:
        img = docker_client.images.get(PAUSE_IMAGE)
        if img.labels.get("org.distlib.kube-build") == hashlib.sha256(marker.encode()).hexdigest()[:12]:
            return PAUSE_IMAGE
    except docker.errors.ImageNotFound:
        pass
    import io
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        tar.add(build_dir / "bin" / "pause", arcname="pause")
        text = b'FROM scratch\nCOPY pause /pause\nENTRYPOINT ["/pause"]\n'
        info = tarfile.TarInfo("Dockerfile")
        info.size = len(text)
        tar.addfile(info, io.BytesIO(text))
    buf.seek(0)
    docker_client.images.build(fileobj=buf, custom_context=True, tag=PAUSE_IMAGE, rm=True,
                               labels={"org.distlib.kube-build": hashlib.sha256(marker.encode()).hexdigest()[:12]})
    return PAUSE_IMAGE


def docker_bridge_ip(docker_client: Any) -> str:
    """The default bridge's gateway address: where pods (dockershim's sandboxes) reach the host."""
    import fcntl

    net = docker_client.networks.get("bridge")
    gateway = net.attrs["IPAM"]["Config"][0].get("Gateway")
    if gateway:
        return str(gateway)
    # not recorded: the bridge interface's own address (SIOCGIFADDR)
    ifname = net.attrs.get("Options", {}).get("com.docker.network.bridge.name", "docker0")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        got = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", ifname.encode()[:15]))
    return socket.inet_ntoa(got[20:24])


def remove_pod_containers(docker_client: Any) -> int:
    """Force-remove the Docker containers of pods in the tests' namespaces (the kubelet keeps
    exited ones for a while); returns how many."""
    gone = 0
    for c in docker_client.containers.list(all=True, filters={"label": "io.kubernetes.pod.namespace"}):
        if c.labels.get("io.kubernetes.pod.namespace", "").startswith(NAMESPACE_PREFIX):
            with contextlib.suppress(Exception):
                c.remove(force=True)
                gone += 1
    return gone


@contextlib.contextmanager
def start(build_dir: Path, workdir: Path, docker_client: Any, timeout_s: float = 90.0) -> Iterator[Cluster]:
    """etcd, the apiserver, controller-manager, scheduler and kubelet, in that order, each waited
    for; stopped (and the tests' pod containers removed) on exit."""
    bin_dir = build_dir / "bin"
    workdir.mkdir(parents=True, exist_ok=True)
    logs = workdir / "logs"
    logs.mkdir(exist_ok=True)
    pki = certs.make(workdir / "pki")  # CA + a serving cert for 127.0.0.1/localhost (EC keys)
    sa_key, sa_pub = _service_account_keys(workdir / "pki")
    token = os.urandom(16).hex()
    (workdir / "tokens.csv").write_text(f'{token},admin,admin,"system:masters"\n')
    etcd_port, peer_port, api_port = _free_port(), _free_port(), _free_port()
    kubelet_port, healthz_port = _free_port(), _free_port()
    server = f"https://127.0.0.1:{api_port}"
    kubeconfig = workdir / "kubeconfig"
    _write_kubeconfig(kubeconfig, server, token, pki["ca"])
    dns_ip = docker_bridge_ip(docker_client)
    resolv = workdir / "resolv.conf"  # what pods with dnsPolicy Default would get: nothing outside
    resolv.write_text("")
    pause = pause_image(docker_client, build_dir)
    api = Api(server, token, pki["ca"])
    cluster = Cluster(api, workdir, kubeconfig, dns_ip, build_dir)

    def run(name: str, *args: str) -> None:
        out = open(logs / f"{name}.log", "wb")
        cluster.processes[name] = subprocess.Popen([str(bin_dir / name), *args], stdout=out,
                                                   stderr=subprocess.STDOUT, start_new_session=True)
        out.close()

    kube_common = ["--kubeconfig", str(kubeconfig), "--leader-elect=false", "--port=0", "--secure-port=0", "--v=1"]
    try:
        run("etcd", "--name", "default", "--data-dir", str(workdir / "etcd"),
            "--listen-client-urls", f"http://127.0.0.1:{etcd_port}",
            "--advertise-client-urls", f"http://127.0.0.1:{etcd_port}",
            "--listen-peer-urls", f"http://127.0.0.1:{peer_port}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer_port}",
            "--initial-cluster", f"default=http://127.0.0.1:{peer_port}", "--log-level", "warn")
        run("kube-apiserver", f"--etcd-servers=http://127.0.0.1:{etcd_port}",
            "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1", f"--secure-port={api_port}",
            f"--tls-cert-file={pki['good_cert']}", f"--tls-private-key-file={pki['good_key']}",
            f"--token-auth-file={workdir / 'tokens.csv'}", "--authorization-mode=AlwaysAllow",
            f"--service-account-issuer={server}", f"--service-account-key-file={sa_pub}",
            f"--service-account-signing-key-file={sa_key}",
            "--service-cluster-ip-range=10.96.0.0/24", "--kubelet-preferred-address-types=Hostname",
            "--v=1")
        def api_ready() -> bool:
            cluster.check_alive()
            return bool(api.request("GET", "/readyz", raw=True) == "ok")

        api.wait("the apiserver's /readyz", api_ready, timeout_s)
        run("kube-controller-manager", *kube_common,
            # the Job controller is the stand-in's (kube_stand_ins.IndexedJobs): 1.20's runs no Indexed Job
            "--controllers=*,-job", f"--service-account-private-key-file={sa_key}",
            f"--root-ca-file={pki['ca']}")
        run("kube-scheduler", *kube_common)
        root = workdir / "kubelet"
        root.mkdir(exist_ok=True)
        sock = f"unix://{workdir / 'dockershim.sock'}"
        run("kubelet", "--kubeconfig", str(kubeconfig), "--container-runtime=docker",
            f"--container-runtime-endpoint={sock}", f"--image-service-endpoint={sock}",
            f"--experimental-dockershim-root-directory={workdir / 'dockershim'}",
            f"--pod-infra-container-image={pause}", f"--root-dir={root}", f"--cert-dir={workdir / 'kubelet-pki'}",
            f"--hostname-override={NODE_NAME}", f"--node-ip={dns_ip}", "--address=127.0.0.1",
            f"--port={kubelet_port}", f"--healthz-port={healthz_port}", "--read-only-port=0",
            "--fail-swap-on=false", "--cgroup-driver=cgroupfs", "--cgroups-per-qos=false",
            "--enforce-node-allocatable=", "--eviction-hard=", "--image-gc-high-threshold=100",
            "--image-gc-low-threshold=99", f"--cluster-dns={dns_ip}", f"--cluster-domain={CLUSTER_DOMAIN}",
            f"--resolv-conf={resolv}", "--maximum-dead-containers=50", "--v=1")

        def node_ready() -> bool:
            cluster.check_alive()
            node = api.get(f"/api/v1/nodes/{NODE_NAME}")
            return any(c["type"] == "Ready" and c["status"] == "True" for c in node["status"]["conditions"])

        api.wait(f"node {NODE_NAME} Ready", node_ready, timeout_s)
        api.wait("the service account default in namespace default",
                 lambda: api.get("/api/v1/namespaces/default/serviceaccounts/default"), timeout_s)
        yield cluster
    finally:
        for name in reversed(list(cluster.processes)):
            proc = cluster.processes[name]
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        remove_pod_containers(docker_client)
        # the kubelet's tmpfs mounts (Secrets, memory emptyDirs) outlive it
        with open("/proc/self/mounts") as f:
            mounts = [line.split()[1] for line in f if line.split()[1].startswith(str(workdir) + "/")]
        for m in sorted(mounts, reverse=True):
            subprocess.run(["umount", "-l", m], check=False)
