"""Run what a Helm chart renders under Docker: the few Kubernetes semantics its pods rely on.

``plan(docs, ...)`` turns rendered manifests (plain dicts, as ``_chart.render`` gives them) into
pods — what the controllers would create — and ``Cluster`` starts those pods as Docker containers
on one private network, waits for the Job, and removes everything after. The point is to run the
chart's *wiring* (names, env, args, volumes, DNS) rather than to look at its YAML; so every field
of a pod, container, Job or Deployment that this module does not emulate raises
``NotEmulated`` instead of being skipped silently: a new chart feature must be mapped here first.

How each Kubernetes feature is mapped (check it against the Kubernetes semantics it stands for):

================================  ===========================================================
Kubernetes                        here
================================  ===========================================================
Deployment (replicas n)           n pods named ``<deployment>-<10 chars>-<5 chars>`` (hostname =
                                  pod name), labels of the template + ``pod-template-hash``;
                                  ``spec.selector`` must select the template (API validation)
Job, ``completionMode: Indexed``  one pod per completion index i, all started at once
                                  (``parallelism`` must equal ``completions``), as the Job
                                  controller creates them: name ``<job>-<i>-<5 chars>``,
                                  hostname ``<job>-<i>`` (unless the template sets one), labels
                                  ``batch.kubernetes.io/controller-uid`` (a fresh uid per plan,
                                  also the old ``controller-uid``), ``batch.kubernetes.io/job-name``
                                  (and ``job-name``), ``batch.kubernetes.io/job-completion-index``,
                                  annotation ``batch.kubernetes.io/job-completion-index``, and
                                  ``JOB_COMPLETION_INDEX`` appended to the env of every container
                                  and init container that does not define it
Job ``backoffLimit: 0``           the first pod that fails fails the Job; the other pods are
                                  stopped (SIGTERM, ``terminationGracePeriodSeconds``, SIGKILL).
                                  Pod retries (``backoffLimit > 0``) are not emulated
Job ``activeDeadlineSeconds``     counted from the Job's first pod start; past it every pod is
                                  stopped and the Job fails with reason ``DeadlineExceeded``
Pod with ``helm.sh/hook: test``   ``Cluster.run_test_pods``: what ``helm test`` runs (after
                                  the install); other hooks raise NotEmulated
pod sandbox (network namespace,   one "sandbox" container per pod (the image, ``sleep``),
hostname, /etc/hosts)             like the kubelet's pause container: it holds the pod's
                                  address, hostname and ``<hostname>.<subdomain>.<ns>.svc.<domain>``
                                  (Docker's ``domainname``: /etc/hosts then reads
                                  ``<ip> <fqdn> <hostname>`` as the kubelet writes it); every
                                  container of the pod joins it (``network_mode=container:``).
                                  Its Docker name is the pod's DNS name when a headless Service
                                  publishes one (else ``<pod>.<ns>``): a reverse lookup of the
                                  pod's address then starts with the hostname, as the PTR record
                                  Kubernetes DNS makes for it
Service ``ClusterIP``             the names ``<svc>``, ``<svc>.<ns>``, ``<svc>.<ns>.svc`` and
                                  ``<svc>.<ns>.svc.<domain>`` (the short ones are what the pod's
                                  DNS search path ``<ns>.svc.<domain> svc.<domain> <domain>``
                                  makes of them) become network aliases of every pod the
                                  selector selects; there is no virtual IP, so each port's
                                  ``targetPort`` (a number, or the *name* of a container port)
                                  must resolve to a container port equal to ``port`` (no proxy
                                  to remap ports). A pod that is not ready yet refuses
                                  connections here as the Service's REJECT rule would there
Service ``clusterIP: None``       the same names resolve to every selected pod (Docker answers
(headless)                        an alias shared by several containers with all of them), and
                                  a selected pod whose ``subdomain`` is the Service's name and
                                  has a hostname gets ``<hostname>.<svc>[.<ns>[.svc[.<domain>]]]``
downward API ``fieldRef``         ``metadata.name/namespace/uid``, ``metadata.labels['k']`` and
                                  ``metadata.annotations['k']`` (an absent key gives "", as the
                                  kubelet does), ``spec.nodeName`` (the Docker host's name),
                                  ``spec.serviceAccountName``, ``status.podIP(s)`` (the sandbox's
                                  address), ``status.hostIP(s)`` (the network's gateway)
``$(VAR)`` in env, command, args  ``_chart.expand_ref``: a value sees only the variables defined
                                  before it in the list; ``$$`` is ``$``; unknown references stay
``command`` / ``args``            Docker ``entrypoint`` / ``command`` (given ``command`` and no
                                  ``args``, the image's CMD is dropped, as in Kubernetes)
``workingDir``                    ``working_dir``
``HOSTNAME``                      set to the pod's hostname, as the container runtime does
``enableServiceLinks``            must be false (the ``<SVC>_PORT=tcp://...`` variables need
                                  virtual IPs); the chart sets it
initContainers                    run one after the other, each to completion, before the
                                  pod's containers; a non-zero exit fails the pod (Init:Error)
``securityContext`` (pod, then    ``runAsUser``/``runAsGroup`` → ``user uid:gid``; ``fsGroup``
container overriding it)          and ``supplementalGroups`` → ``group_add``; ``runAsNonRoot``
                                  → refuse to start a container whose user would be uid 0;
                                  ``capabilities`` → ``cap_add``/``cap_drop``;
                                  ``allowPrivilegeEscalation: false`` → ``no-new-privileges``;
                                  ``readOnlyRootFilesystem`` → ``read_only``; ``privileged``;
                                  seccomp ``RuntimeDefault`` → Docker's default profile
``resources``                     ``limits.cpu`` → ``nano_cpus``, ``limits.memory`` →
                                  ``mem_limit``, ``requests.cpu`` → ``cpu_shares`` (the kubelet's
                                  cgroup weight), ``requests.memory`` → ``mem_reservation``;
                                  other resources (GPUs) raise NotEmulated
emptyDir ``medium: Memory``       at /dev/shm: ``shm_size`` = ``sizeLimit``; elsewhere a tmpfs
                                  mount (one container only: not shared inside the pod)
emptyDir (disk)                   a Docker volume of its own for the pod (mode 0777, as the
                                  kubelet makes it), shared by the pod's containers
persistentVolumeClaim, nfs        the Docker volume ``storage["pvc/<claim>"]`` or
                                  ``storage["nfs/<server>:<path>"]`` that the caller created: a
                                  named volume every pod mounts stands in for ReadWriteMany
                                  storage. Docker copies nothing into it (``no_copy``); the
                                  kubelet's ``fsGroup`` ownership change is done once, as root
                                  (``chgrp <fsGroup>``, ``chmod 2775``). ``subPath`` raises
                                  NotEmulated (Docker 20.10's API has no volume sub-paths)
Secret, ``secret`` volume         the Secret's data (rendered with the chart, or passed to
                                  ``Cluster(secrets=...)`` as one that already exists) written
                                  into a Docker volume of the pod's, one file per item, as root
                                  with ``defaultMode`` and, with ``fsGroup``, that group and
                                  group read (the kubelet's ownership change); mounted read-only
                                  (the kubelet always does). A Secret nobody has is
                                  ContainerCreating (PodFailed). Per-item modes and ``optional``
                                  raise NotEmulated
exec probes                       ``Cluster.probe``: the command run in the container
                                  (``exec_run``), as the kubelet's exec probe does
``imagePullPolicy``               nothing is pulled: the image must be present locally
placement, pull secrets, service  ignored: ``nodeSelector``, ``tolerations``, ``affinity``,
account token, priority, runtime  ``priorityClassName``, ``runtimeClassName``,
class, TTL, revision history,     ``imagePullSecrets``, ``automountServiceAccountToken``,
Deployment strategy, ports        ``ttlSecondsAfterFinished``, ``revisionHistoryLimit``,
                                  ``strategy``, ``ports`` (Docker containers on one network reach
                                  each other on every port)
================================  ===========================================================

Everything the pods need runs on one Docker network; the helper never pulls an image.
"""

from __future__ import annotations

import base64
import contextlib
import copy
import io
import re
import secrets
import string
import tarfile
import time
import uuid
from dataclasses import dataclass, field
from collections.abc import Callable, Iterable
from typing import Any

from ._chart import expand_ref


class NotEmulated(NotImplementedError):
    """A manifest uses a Kubernetes feature this module does not emulate."""


class PodFailed(AssertionError):
    """A pod (or an init container) exited non-zero, or could not start."""


class JobFailed(AssertionError):
    """The Job failed (a pod failed with backoffLimit 0, or DeadlineExceeded); ``result`` says how."""

    def __init__(self, message: str, result: JobResult):
        super().__init__(message)
        self.result = result


# --- quantities ---------------------------------------------------------------------------------

_SUFFIX = {"": 1, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18,
           "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}


def quantity(value: Any) -> float:
    """A Kubernetes resource quantity ("500m", "1Gi", "2", 3) as a number."""
    m = re.fullmatch(r"\s*([0-9.]+(?:[eE][-+]?[0-9]+)?)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m.group(2) not in _SUFFIX:
        raise ValueError(f"not a Kubernetes quantity: {value!r}")
    return float(m.group(1)) * _SUFFIX[m.group(2)]


# --- what the controllers make of the manifests ------------------------------------------------


@dataclass
class Container:
    """A container of a pod, as the manifest gives it (env is resolved when the pod starts)."""

    spec: dict[str, Any]
    init: bool = False

    @property
    def name(self) -> str:
        return self.spec["name"]


@dataclass
class Pod:
    """One pod as its controller would create it."""

    name: str
    namespace: str
    cluster_domain: str
    owner: str                      # "Job/<name>", "Deployment/<name>" or "Pod/<name>"
    labels: dict[str, str]
    annotations: dict[str, str]
    spec: dict[str, Any]            # the pod spec (a deep copy of the template's)
    hostname: str
    uid: str = field(default_factory=lambda: str(uuid.uuid4()))
    completion_index: int | None = None
    dns_names: list[str] = field(default_factory=list)   # network aliases, filled by the Services
    published_fqdn: str | None = None  # <hostname>.<subdomain>... when a headless Service publishes it

    @property
    def subdomain(self) -> str | None:
        return self.spec.get("subdomain")

    @property
    def fqdn(self) -> str | None:
        """``<hostname>.<subdomain>.<ns>.svc.<domain>`` when the pod has a subdomain."""
        if not self.subdomain:
            return None
        return f"{self.hostname}.{self.subdomain}.{self.namespace}.svc.{self.cluster_domain}"

    @property
    def init_containers(self) -> list[Container]:
        return [Container(c, init=True) for c in self.spec.get("initContainers", [])]

    @property
    def containers(self) -> list[Container]:
        return [Container(c) for c in self.spec["containers"]]

    def container(self, name: str) -> Container:
        (found,) = [c for c in self.containers if c.name == name]
        return found


@dataclass
class Plan:
    """The pods of one rendering and the Services' DNS names, in the order Helm creates them."""

    namespace: str
    cluster_domain: str
    pods: list[Pod]                 # Deployment pods first, then the Job's (Helm's install order)
    test_pods: list[Pod]            # helm.sh/hook: test
    services: list[dict[str, Any]]
    job: dict[str, Any] | None
    job_uid: str | None
    endpoints: dict[str, list[str]]  # Service name -> names of the pods it selects
    secrets: dict[str, dict[str, bytes]] = field(default_factory=dict)  # Secret name -> its data

    @property
    def job_pods(self) -> list[Pod]:
        return [p for p in self.pods if p.completion_index is not None]

    def pods_of(self, owner: str) -> list[Pod]:
        return [p for p in self.pods if p.owner == owner]


_RAND = string.ascii_lowercase + string.digits


def _rand(n: int) -> str:
    return "".join(secrets.choice(_RAND) for _ in range(n))


def _matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


_POD_KEYS = {
    "containers", "initContainers", "volumes", "restartPolicy", "subdomain", "hostname",
    "enableServiceLinks", "automountServiceAccountToken", "terminationGracePeriodSeconds",
    "securityContext", "imagePullSecrets", "nodeSelector", "tolerations", "affinity",
    "priorityClassName", "runtimeClassName",
}
_CONTAINER_KEYS = {
    "name", "image", "imagePullPolicy", "command", "args", "env", "workingDir", "ports",
    "resources", "securityContext", "volumeMounts", "readinessProbe", "livenessProbe",
}
_POD_SECURITY_KEYS = {"runAsNonRoot", "runAsUser", "runAsGroup", "fsGroup", "fsGroupChangePolicy",
                      "seccompProfile", "supplementalGroups"}
_CONTAINER_SECURITY_KEYS = {"runAsNonRoot", "runAsUser", "runAsGroup", "seccompProfile", "capabilities",
                            "allowPrivilegeEscalation", "readOnlyRootFilesystem", "privileged"}
_JOB_KEYS = {"completionMode", "completions", "parallelism", "backoffLimit", "activeDeadlineSeconds",
             "ttlSecondsAfterFinished", "template"}
_DEPLOYMENT_KEYS = {"replicas", "strategy", "revisionHistoryLimit", "selector", "template"}


def _check_keys(where: str, obj: dict[str, Any], known: set[str]) -> None:
    unknown = sorted(set(obj) - known)
    if unknown:
        raise NotEmulated(f"{where}: {', '.join(unknown)} not emulated (tests/helm/_pods.py)")


def _check_pod_spec(where: str, spec: dict[str, Any]) -> None:
    _check_keys(where, spec, _POD_KEYS)
    if spec.get("enableServiceLinks", True) is not False:
        raise NotEmulated(f"{where}: service links (enableServiceLinks not false) need virtual IPs")
    _check_keys(f"{where} securityContext", spec.get("securityContext", {}), _POD_SECURITY_KEYS)
    for c in spec.get("initContainers", []) + spec["containers"]:
        _check_keys(f"{where} container {c['name']}", c, _CONTAINER_KEYS)
        _check_keys(f"{where} container {c['name']} securityContext", c.get("securityContext", {}),
                    _CONTAINER_SECURITY_KEYS)
        if "envFrom" in c:
            raise NotEmulated(f"{where} container {c['name']}: envFrom")
        if "livenessProbe" in c or "readinessProbe" in c:
            for kind in ("livenessProbe", "readinessProbe"):
                if kind in c and "exec" not in c[kind]:
                    raise NotEmulated(f"{where} container {c['name']}: {kind} other than exec")


def _pod(owner: str, name: str, hostname: str, template: dict[str, Any], namespace: str,
         cluster_domain: str, labels: dict[str, str] | None = None,
         annotations: dict[str, str] | None = None, index: int | None = None) -> Pod:
    meta = template.get("metadata", {})
    spec = copy.deepcopy(template["spec"])
    return Pod(
        name=name, namespace=namespace, cluster_domain=cluster_domain, owner=owner,
        labels={**meta.get("labels", {}), **(labels or {})},
        annotations={**meta.get("annotations", {}), **(annotations or {})},
        spec=spec, hostname=spec.get("hostname") or hostname, completion_index=index,
    )


def _deployment_pods(d: dict[str, Any], namespace: str, cluster_domain: str) -> list[Pod]:
    name = d["metadata"]["name"]
    where = f"Deployment/{name}"
    _check_keys(where, d["spec"], _DEPLOYMENT_KEYS)
    tmpl = d["spec"]["template"]
    _check_pod_spec(where, tmpl["spec"])
    selector = d["spec"]["selector"]
    if set(selector) != {"matchLabels"}:
        raise NotEmulated(f"{where}: selector other than matchLabels")
    if not _matches(selector["matchLabels"], tmpl["metadata"]["labels"]):
        raise AssertionError(f"{where}: spec.selector does not select the pod template (the API refuses it)")
    template_hash = _rand(10)
    pods = []
    for _ in range(int(d["spec"].get("replicas", 1))):
        pod_name = f"{name}-{template_hash}-{_rand(5)}"
        pods.append(_pod(f"Deployment/{name}", pod_name, pod_name, tmpl, namespace, cluster_domain,
                         labels={"pod-template-hash": template_hash}))
    return pods


def _job_pods(job: dict[str, Any], job_uid: str, namespace: str, cluster_domain: str) -> list[Pod]:
    name = job["metadata"]["name"]
    where = f"Job/{name}"
    spec = job["spec"]
    _check_keys(where, spec, _JOB_KEYS)
    if spec.get("completionMode") != "Indexed":
        raise NotEmulated(f"{where}: only completionMode Indexed is emulated")
    completions = int(spec["completions"])
    if int(spec.get("parallelism", 1)) != completions:
        raise NotEmulated(f"{where}: parallelism != completions (pods started in waves)")
    if int(spec.get("backoffLimit", 6)) != 0:
        raise NotEmulated(f"{where}: backoffLimit > 0 (pod retries)")
    tmpl = copy.deepcopy(spec["template"])
    _check_pod_spec(where, tmpl["spec"])
    if tmpl["spec"].get("restartPolicy") not in ("Never", "OnFailure"):
        raise AssertionError(f"{where}: a Job's pods need restartPolicy Never or OnFailure")
    if tmpl["spec"]["restartPolicy"] != "Never":
        raise NotEmulated(f"{where}: restartPolicy OnFailure (container restarts)")
    # The Job controller adds JOB_COMPLETION_INDEX to every container that does not define it.
    for c in tmpl["spec"]["containers"] + tmpl["spec"].get("initContainers", []):
        env = c.setdefault("env", [])
        if not any(v["name"] == "JOB_COMPLETION_INDEX" for v in env):
            env.append({"name": "JOB_COMPLETION_INDEX", "valueFrom": {"fieldRef": {
                "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}})
    pods = []
    for i in range(completions):
        labels = {
            "batch.kubernetes.io/controller-uid": job_uid, "controller-uid": job_uid,
            "batch.kubernetes.io/job-name": name, "job-name": name,
            "batch.kubernetes.io/job-completion-index": str(i),
        }
        annotations = {"batch.kubernetes.io/job-completion-index": str(i)}
        pods.append(_pod(where, f"{name}-{i}-{_rand(5)}", f"{name}-{i}", tmpl, namespace,
                         cluster_domain, labels, annotations, index=i))
    return pods


def _port_of(pod: Pod, target: Any) -> int | None:
    """The container port a Service's targetPort (a number or a port name) means in ``pod``."""
    for c in pod.spec["containers"]:
        for p in c.get("ports", []):
            if (isinstance(target, str) and p.get("name") == target) or (
                not isinstance(target, str) and int(p["containerPort"]) == int(target)
            ):
                return int(p["containerPort"])
    return None if isinstance(target, str) else int(target)


def _add_service_names(svc: dict[str, Any], pods: list[Pod], namespace: str,
                       cluster_domain: str) -> list[str]:
    """Give the pods a Service selects the DNS names it publishes; return their names."""
    name = svc["metadata"]["name"]
    spec = svc["spec"]
    if spec.get("type", "ClusterIP") != "ClusterIP":
        raise NotEmulated(f"Service/{name}: type {spec['type']}")
    selector = spec.get("selector")
    if not selector:
        raise NotEmulated(f"Service/{name}: a Service without selector (manual Endpoints)")
    selected = [p for p in pods if _matches(selector, p.labels)]
    headless = spec.get("clusterIP") == "None"
    for port in spec.get("ports", []):
        if port.get("protocol", "TCP") != "TCP":
            raise NotEmulated(f"Service/{name}: protocol {port['protocol']}")
        target = port.get("targetPort", port["port"])
        for p in selected:
            resolved = _port_of(p, target)
            if resolved is None:
                # Kubernetes lists no endpoint for a pod without the named port: no traffic.
                raise AssertionError(f"Service/{name} port {port['port']}: pod {p.name} has no "
                                     f"container port named {target!r}")
            if not headless and resolved != int(port["port"]):
                raise NotEmulated(f"Service/{name}: port {port['port']} -> {resolved} needs a proxy")
    forms = [name, f"{name}.{namespace}", f"{name}.{namespace}.svc",
             f"{name}.{namespace}.svc.{cluster_domain}"]
    for p in selected:
        p.dns_names.extend(forms)
        if headless and p.subdomain == name and p.hostname:
            h = p.hostname
            p.published_fqdn = f"{h}.{name}.{namespace}.svc.{cluster_domain}"
            p.dns_names.extend([f"{h}.{name}", f"{h}.{name}.{namespace}", f"{h}.{name}.{namespace}.svc",
                                f"{h}.{name}.{namespace}.svc.{cluster_domain}"])
    return [p.name for p in selected]


def plan(docs: Iterable[dict[str, Any]], namespace: str, cluster_domain: str = "cluster.local",
         job_uid: str | None = None) -> Plan:
    """The pods the controllers would create from ``docs``, with the Services' DNS names."""
    docs = list(docs)
    pods: list[Pod] = []
    tests: list[Pod] = []
    services: list[dict[str, Any]] = []
    secret_data: dict[str, dict[str, bytes]] = {}
    job = None
    kinds = {"Deployment": 0, "Job": 1, "Pod": 2}
    for d in sorted(docs, key=lambda d: kinds.get(d["kind"], -1)):
        kind, name = d["kind"], d["metadata"]["name"]
        if d["metadata"].get("namespace", namespace) != namespace:
            raise NotEmulated(f"{kind}/{name}: another namespace")
        hook = d["metadata"].get("annotations", {}).get("helm.sh/hook")
        if hook and not (kind == "Pod" and hook == "test"):
            raise NotEmulated(f"{kind}/{name}: helm hook {hook!r}")
        if kind == "Service":
            services.append(d)
        elif kind == "Deployment":
            pods.extend(_deployment_pods(d, namespace, cluster_domain))
        elif kind == "Job":
            if job is not None:
                raise NotEmulated("more than one Job")
            job = d
            job_uid = job_uid or str(uuid.uuid4())
            pods.extend(_job_pods(d, job_uid, namespace, cluster_domain))
        elif kind == "Pod":
            _check_pod_spec(f"Pod/{name}", d["spec"])
            pod = _pod(f"Pod/{name}", name, name, d, namespace, cluster_domain)
            (tests if hook == "test" else pods).append(pod)
        elif kind == "Secret":
            secret_data[name] = {k: base64.b64decode(v) for k, v in (d.get("data") or {}).items()}
            secret_data[name].update({k: str(v).encode() for k, v in (d.get("stringData") or {}).items()})
        elif kind in ("ConfigMap", "ServiceAccount", "PodDisruptionBudget", "NetworkPolicy"):
            continue  # nothing here reads them (NetworkPolicies: the containers' network is the run's alone)
        else:
            raise NotEmulated(f"{kind}/{name}")
    endpoints = {s["metadata"]["name"]: _add_service_names(s, pods + tests, namespace, cluster_domain)
                 for s in services}
    return Plan(namespace, cluster_domain, pods, tests, services, job,
                job_uid if job is not None else None, endpoints, secret_data)


# --- the kubelet's part -------------------------------------------------------------------------


_FIELD = re.compile(r"^metadata\.(labels|annotations)\['([^']+)'\]$")


def pod_field(pod: Pod, path: str, pod_ip: str, host_ip: str, node_name: str) -> str:
    """What a downward-API fieldRef gives (an absent label or annotation gives "")."""
    m = _FIELD.match(path)
    if m:
        return (pod.labels if m.group(1) == "labels" else pod.annotations).get(m.group(2), "")
    simple = {
        "metadata.name": pod.name, "metadata.namespace": pod.namespace, "metadata.uid": pod.uid,
        "spec.nodeName": node_name, "spec.serviceAccountName": "default",
        "status.podIP": pod_ip, "status.podIPs": pod_ip, "status.hostIP": host_ip, "status.hostIPs": host_ip,
    }
    if path not in simple:
        raise NotEmulated(f"fieldRef {path!r} (the API would refuse an unknown one)")
    return simple[path]


def container_env(spec: dict[str, Any], field_of: Callable[[str], str]) -> dict[str, str]:
    """The variables the kubelet sets, in order: each value may use the ones defined before it."""
    env: dict[str, str] = {}
    for var in spec.get("env", []):
        if "valueFrom" in var:
            src = var["valueFrom"]
            if set(src) != {"fieldRef"}:
                raise NotEmulated(f"env {var['name']}: valueFrom {sorted(src)}")
            env[var["name"]] = field_of(src["fieldRef"]["fieldPath"])
        else:
            env[var["name"]] = expand_ref(str(var.get("value", "")), env)
    return env


def security(pod_sc: dict[str, Any], sc: dict[str, Any], image_user: str, where: str) -> dict[str, Any]:
    """Docker options for a container's effective security context (pod's, then container's)."""
    merged = {**{k: v for k, v in pod_sc.items() if k in ("runAsUser", "runAsGroup", "runAsNonRoot",
                                                            "seccompProfile")}, **sc}
    out: dict[str, Any] = {}
    uid = merged.get("runAsUser")
    gid = merged.get("runAsGroup")
    if uid is not None:
        out["user"] = f"{int(uid)}:{int(gid)}" if gid is not None else str(int(uid))
    elif gid is not None:
        raise NotEmulated(f"{where}: runAsGroup without runAsUser")
    if merged.get("runAsNonRoot"):
        effective = str(uid) if uid is not None else (image_user or "0").split(":")[0]
        if not effective.isdigit():
            raise PodFailed(f"{where}: CreateContainerConfigError: runAsNonRoot and the image has a "
                            f"non-numeric user {image_user!r}")
        if int(effective) == 0:
            raise PodFailed(f"{where}: CreateContainerConfigError: container has runAsNonRoot and "
                            "image will run as root")
    groups = [str(g) for g in pod_sc.get("supplementalGroups", [])]
    if "fsGroup" in pod_sc:
        groups.append(str(pod_sc["fsGroup"]))
    if groups:
        out["group_add"] = groups
    caps = merged.get("capabilities", {})
    if caps.get("drop"):
        out["cap_drop"] = list(caps["drop"])
    if caps.get("add"):
        out["cap_add"] = list(caps["add"])
    opts = []
    if merged.get("allowPrivilegeEscalation") is False:
        opts.append("no-new-privileges")
    seccomp = (merged.get("seccompProfile") or {}).get("type", "RuntimeDefault")
    if seccomp == "Unconfined":
        opts.append("seccomp=unconfined")
    elif seccomp != "RuntimeDefault":
        raise NotEmulated(f"{where}: seccompProfile {seccomp}")
    if opts:
        out["security_opt"] = opts
    if merged.get("readOnlyRootFilesystem"):
        out["read_only"] = True
    if merged.get("privileged"):
        out["privileged"] = True
    return out


def resources(res: dict[str, Any], where: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind, values in res.items():
        for name, value in (values or {}).items():
            if name == "cpu":
                if kind == "limits":
                    out["nano_cpus"] = int(quantity(value) * 1e9)
                else:
                    out["cpu_shares"] = max(2, int(quantity(value) * 1024))
            elif name == "memory":
                out["mem_limit" if kind == "limits" else "mem_reservation"] = int(quantity(value))
            else:
                raise NotEmulated(f"{where}: resource {name}")
    return out


@dataclass
class Exited:
    """A container that ran to completion."""

    pod: Pod
    container: str
    exit_code: int
    logs: str
    docker: Any          # the docker-py container (still there until the test ends)


@dataclass
class JobResult:
    pods: dict[int, Exited]          # completion index -> its container's outcome
    reason: str                      # "Complete", "BackoffLimitExceeded", "DeadlineExceeded"
    seconds: float

    def failed(self) -> dict[int, Exited]:
        return {i: e for i, e in self.pods.items() if e.exit_code != 0}


class Cluster:
    """Runs a Plan's pods as Docker containers on ``network`` (a testcontainers Network).

    ``start(image, command, network, aliases, **docker_kwargs)`` starts a container and returns
    a testcontainers container (the ``container_factory`` fixture's signature: it labels the
    container and removes it after the test). ``storage`` maps ``pvc/<claim>`` or
    ``nfs/<server>:<path>`` to the name of a Docker volume that already exists; ``secrets`` are
    the Secrets the namespace already holds (name -> data), besides those the plan renders. Use as
    a context manager: on exit every container this Cluster started is removed, then the volumes
    it made.
    """

    def __init__(self, client: Any, start: Callable[..., Any], network: Any, plan: Plan,
                 storage: dict[str, str] | None = None, labels: dict[str, str] | None = None,
                 secrets: dict[str, dict[str, bytes]] | None = None):
        self.client = client
        self.start = start
        self.network = network
        self.plan = plan
        self.storage = dict(storage or {})
        self.secrets = {**(secrets or {}), **plan.secrets}
        self.labels = dict(labels or {})
        self.started: list[Any] = []          # testcontainers objects, in start order
        self.volumes: list[Any] = []          # Docker volumes this Cluster created
        self.prepared: set[str] = set()       # volumes whose fsGroup ownership is done
        self.running: dict[str, dict[str, Any]] = {}  # pod name -> {container name: docker object}
        self.sandboxes: dict[str, Any] = {}
        self.job_started_at: float | None = None
        self.node_name = client.info().get("Name", "docker")

    # -- lifetime

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for ctr in reversed(self.started):
            with contextlib.suppress(Exception):
                ctr.stop()
        for vol in self.volumes:
            with contextlib.suppress(Exception):
                vol.remove(force=True)

    # -- docker helpers

    def _docker_labels(self, pod: Pod, container: str) -> dict[str, str]:
        return {**self.labels, "io.kubernetes.pod.name": pod.name, "io.kubernetes.pod.namespace": pod.namespace,
                "io.kubernetes.container.name": container}

    def _start(self, image: str, command: Any, pod: Pod, container: str, **kw: Any) -> Any:
        kw["labels"] = {**kw.get("labels", {}), **self._docker_labels(pod, container)}
        ctr = self.start(image, command, **kw)
        self.started.append(ctr)
        return ctr.get_wrapped_container()

    def _image_user(self, image: str) -> str:
        import docker

        try:
            return self.client.images.get(image).attrs["Config"].get("User", "")
        except docker.errors.ImageNotFound:
            raise PodFailed(f"image {image} is not present (nothing is pulled here: build it first)") from None

    def _volume(self, name: str, prepare_as: tuple[int | None, str]) -> str:
        """Make the kubelet's ownership of a fresh volume: group fsGroup, setgid, group-writable
        (for an emptyDir: mode 0777). Done once per volume, as root."""
        if name in self.prepared:
            return name
        gid, mode = prepare_as
        script = f"chmod {mode} /v" + (f" && chgrp {gid} /v" if gid is not None else "")
        image = self.plan.pods[0].spec["containers"][0]["image"] if self.plan.pods else None
        from docker.types import Mount

        self.client.containers.run(
            image, ["sh", "-c", script], user="0:0", remove=True, network_mode="none",
            mounts=[Mount("/v", name, type="volume", no_copy=True)], labels=self.labels,
        )
        self.prepared.add(name)
        return name

    def _secret_volume(self, pod: Pod, v: dict[str, Any], fs_group: int | None) -> str:
        """A Docker volume holding the Secret's items as the kubelet writes them."""
        from docker.types import Mount

        src = v["secret"]
        unknown = sorted(set(src) - {"secretName", "items", "defaultMode"})
        if unknown:
            raise NotEmulated(f"pod {pod.name}: secret volume {v['name']}: {', '.join(unknown)}")
        data = self.secrets.get(src["secretName"])
        if data is None:
            raise PodFailed(f"pod {pod.name}: ContainerCreating: secret {src['secretName']!r} not found")
        items = src.get("items") or [{"key": k, "path": k} for k in sorted(data)]
        mode = int(src.get("defaultMode", 0o644)) | (0o040 if fs_group is not None else 0)
        archive = io.BytesIO()
        with tarfile.open(fileobj=archive, mode="w") as tar:
            for item in items:
                if set(item) - {"key", "path"}:
                    raise NotEmulated(f"pod {pod.name}: secret item {item}")
                if item["key"] not in data:
                    raise PodFailed(f"pod {pod.name}: ContainerCreating: secret {src['secretName']!r} has no "
                                    f"key {item['key']!r}")
                info = tarfile.TarInfo(item["path"])
                info.size, info.mode, info.uid, info.gid = len(data[item["key"]]), mode, 0, fs_group or 0
                info.mtime = int(time.time())
                tar.addfile(info, io.BytesIO(data[item["key"]]))
        vol = self.client.volumes.create(f"{pod.name}.{pod.namespace}.{v['name']}", labels=self.labels)
        self.volumes.append(vol)
        image = pod.spec["containers"][0]["image"]
        writer = self.client.containers.create(image, ["true"], user="0:0", network_mode="none", labels=self.labels,
                                               mounts=[Mount("/v", vol.name, type="volume", no_copy=True)])
        try:
            assert writer.put_archive("/v", archive.getvalue()), f"could not write secret {src['secretName']}"
        finally:
            writer.remove(force=True)
        return vol.name

    # -- pods

    def _mounts(self, pod: Pod, c: dict[str, Any], pod_volumes: dict[str, str]) -> dict[str, Any]:
        from docker.types import Mount

        volumes = {v["name"]: v for v in pod.spec.get("volumes", [])}
        kw: dict[str, Any] = {"mounts": []}
        for vm in c.get("volumeMounts", []):
            if vm.get("subPath") or vm.get("subPathExpr"):
                raise NotEmulated(f"pod {pod.name} container {c['name']}: volumeMount subPath")
            vol = volumes[vm["name"]]
            path = vm["mountPath"]
            ro = bool(vm.get("readOnly", False))
            if "secret" in vol:
                ro = True  # the kubelet mounts Secrets read-only whatever the manifest says
            if "emptyDir" in vol and vol["emptyDir"].get("medium") == "Memory":
                size = vol["emptyDir"].get("sizeLimit")
                if path == "/dev/shm":
                    kw["shm_size"] = int(quantity(size)) if size else None
                else:
                    kw["mounts"].append(Mount(path, None, type="tmpfs", read_only=ro,
                                              tmpfs_size=int(quantity(size)) if size else None,
                                              tmpfs_mode=0o1777))
            else:
                kw["mounts"].append(Mount(path, pod_volumes[vm["name"]], type="volume", read_only=ro,
                                          no_copy=True))
        if kw.get("shm_size") is None:
            kw.pop("shm_size", None)
        return kw

    def _pod_volumes(self, pod: Pod) -> dict[str, str]:
        """Docker volume names of the pod's disk-backed volumes, created/prepared as needed."""
        fs_group = pod.spec.get("securityContext", {}).get("fsGroup")
        out: dict[str, str] = {}
        for v in pod.spec.get("volumes", []):
            if "emptyDir" in v:
                if v["emptyDir"].get("medium") == "Memory":
                    mounts = [c for c in pod.spec["containers"] + pod.spec.get("initContainers", [])
                              if any(m["name"] == v["name"] for m in c.get("volumeMounts", []))]
                    if len(mounts) > 1:
                        raise NotEmulated(f"pod {pod.name}: memory emptyDir {v['name']} in two containers")
                    continue
                vol = self.client.volumes.create(f"{pod.name}.{pod.namespace}.{v['name']}", labels=self.labels)
                self.volumes.append(vol)
                out[v["name"]] = self._volume(vol.name, (fs_group, "0777"))
            elif "persistentVolumeClaim" in v:
                key = f"pvc/{v['persistentVolumeClaim']['claimName']}"
                if key not in self.storage:
                    raise PodFailed(f"pod {pod.name}: Pending: no volume for {key} (storage={self.storage})")
                out[v["name"]] = self._volume(self.storage[key], (fs_group, "2775"))
            elif "nfs" in v:
                key = f"nfs/{v['nfs']['server']}:{v['nfs']['path']}"
                if key not in self.storage:
                    raise PodFailed(f"pod {pod.name}: ContainerCreating: no volume for {key}")
                out[v["name"]] = self.storage[key]  # NFS: the kubelet changes no ownership
            elif "secret" in v:
                out[v["name"]] = self._secret_volume(pod, v, fs_group)
            else:
                raise NotEmulated(f"pod {pod.name}: volume {sorted(v)}")
        return out

    def _container_kwargs(self, pod: Pod, c: dict[str, Any], sandbox: Any, pod_ip: str,
                          pod_volumes: dict[str, str]) -> tuple[str, dict[str, Any]]:
        where = f"pod {pod.name} container {c['name']}"
        image = c["image"]
        image_user = self._image_user(image)
        host_ip = self.network_gateway()

        def field_of(path: str) -> str:
            return pod_field(pod, path, pod_ip, host_ip, self.node_name)

        env = container_env(c, field_of)
        env.setdefault("HOSTNAME", pod.hostname)
        kw: dict[str, Any] = {"env": env, "network_mode": f"container:{sandbox.id}",
                              "name": f"k8s_{c['name']}_{pod.name}_{pod.namespace}"}
        if "command" in c:
            kw["entrypoint"] = [expand_ref(a, env) for a in c["command"]]
        args = [expand_ref(a, env) for a in c["args"]] if "args" in c else None
        if args is None and "command" in c:
            args = []  # Kubernetes: command without args drops the image's CMD
        if c.get("workingDir"):
            kw["working_dir"] = c["workingDir"]
        kw.update(security(pod.spec.get("securityContext", {}), c.get("securityContext", {}), image_user, where))
        kw.update(resources(c.get("resources", {}), where))
        kw.update(self._mounts(pod, c, pod_volumes))
        kw["_args"] = args
        return image, kw

    def network_gateway(self) -> str:
        net = self.network._network  # the docker-py object (testcontainers has no accessor)
        net.reload()
        return net.attrs["IPAM"]["Config"][0].get("Gateway", "")

    def start_pod(self, pod: Pod) -> dict[str, Any]:
        """Sandbox, init containers (each to completion), then the pod's containers, started."""
        image = pod.spec["containers"][0]["image"]
        self._image_user(image)
        # Docker answers a reverse lookup with the container's name: the pod's DNS name when a
        # headless Service publishes one (Kubernetes' PTR record), else "<pod>.<namespace>".
        sandbox_name = pod.published_fqdn or f"{pod.name}.{pod.namespace}"
        sandbox_kw: dict[str, Any] = {
            "name": sandbox_name, "hostname": pod.hostname, "entrypoint": ["sleep"],
            "user": "65535:65535", "cap_drop": ["ALL"], "security_opt": ["no-new-privileges"],
        }
        if pod.fqdn:
            sandbox_kw["domainname"] = pod.fqdn.split(".", 1)[1]
        sandbox = self._start(image, ["infinity"], pod, "POD", network=self.network,
                              aliases=tuple(dict.fromkeys(pod.dns_names)), **sandbox_kw)
        sandbox.reload()
        pod_ip = sandbox.attrs["NetworkSettings"]["Networks"][self.network.name]["IPAddress"]
        self.sandboxes[pod.name] = sandbox
        volumes = self._pod_volumes(pod)
        for ic in pod.init_containers:
            img, kw = self._container_kwargs(pod, ic.spec, sandbox, pod_ip, volumes)
            ctr = self._start(img, kw.pop("_args"), pod, ic.name, **kw)
            code = int(ctr.wait()["StatusCode"])
            if code != 0:
                logs = ctr.logs().decode("utf-8", "replace")
                raise PodFailed(f"pod {pod.name}: Init:Error: init container {ic.name} exited {code}:\n{logs}")
        running = {}
        for c in pod.containers:
            img, kw = self._container_kwargs(pod, c.spec, sandbox, pod_ip, volumes)
            running[c.name] = self._start(img, kw.pop("_args"), pod, c.name, **kw)
        self.running[pod.name] = running
        return running

    def start_all(self) -> None:
        """Every pod of the plan, in Helm's order, without waiting for any to be ready (the
        Deployment's and the Job's pods start together in a cluster)."""
        for pod in self.plan.pods:
            if pod.completion_index is not None and self.job_started_at is None:
                self.job_started_at = time.monotonic()
            self.start_pod(pod)

    def pod_ip(self, pod: Pod) -> str:
        """The pod's address (its sandbox's, on the network)."""
        sandbox = self.sandboxes[pod.name]
        sandbox.reload()
        return sandbox.attrs["NetworkSettings"]["Networks"][self.network.name]["IPAddress"]

    def probe(self, pod: Pod, container: str, kind: str = "readinessProbe") -> tuple[int, str]:
        """Run an exec probe once in a running container: (exit code, output)."""
        command = pod.container(container).spec[kind]["exec"]["command"]
        code, out = self.running[pod.name][container].exec_run(command)
        return int(code), out.decode("utf-8", "replace")

    def wait_ready(self, pod: Pod, container: str, timeout_s: float = 60.0) -> float:
        """Run the readiness probe as the kubelet does (after initialDelaySeconds, every
        periodSeconds) until it succeeds; return the seconds it took, or raise PodFailed."""
        p = pod.container(container).spec["readinessProbe"]
        started = time.monotonic()
        time.sleep(float(p.get("initialDelaySeconds", 0)))
        last = ""
        while time.monotonic() - started < timeout_s:
            code, last = self.probe(pod, container)
            if code == 0:
                return time.monotonic() - started
            time.sleep(float(p.get("periodSeconds", 10)))
        raise PodFailed(f"pod {pod.name}: readiness probe never succeeded in {timeout_s:.0f}s: {last}")

    def _stop_pods(self, pods: list[Pod]) -> None:
        for pod in pods:
            grace = int(pod.spec.get("terminationGracePeriodSeconds", 30))
            for ctr in self.running.get(pod.name, {}).values():
                with contextlib.suppress(Exception):
                    ctr.stop(timeout=grace)

    def wait_job(self, container: str, timeout_s: float, poll_s: float = 0.5) -> JobResult:
        """Wait for the container ``container`` of every Job pod to exit; the Job's result.

        backoffLimit 0: the first non-zero exit fails the Job (BackoffLimitExceeded) and stops
        the other pods. activeDeadlineSeconds (or ``timeout_s``, the test's own limit) stops them
        all (DeadlineExceeded). Raises JobFailed unless every pod exited 0."""
        pods = self.plan.job_pods
        started = self.job_started_at or time.monotonic()
        deadline = self.plan.job["spec"].get("activeDeadlineSeconds") if self.plan.job else None
        limit = min(float(deadline), timeout_s) if deadline is not None else timeout_s
        done: dict[int, Exited] = {}
        reason = "Complete"
        while len(done) < len(pods):
            for pod in pods:
                if pod.completion_index in done:
                    continue
                ctr = self.running[pod.name][container]
                ctr.reload()
                if ctr.status in ("exited", "dead"):
                    code = int(ctr.attrs["State"]["ExitCode"])
                    done[pod.completion_index] = Exited(pod, container, code,
                                                        ctr.logs().decode("utf-8", "replace"), ctr)
                    if code != 0 and reason == "Complete":
                        reason = "BackoffLimitExceeded"
            if reason != "Complete":
                break
            if time.monotonic() - started > limit:
                reason = "DeadlineExceeded" if deadline is not None and limit == float(deadline) else \
                    f"test timeout {timeout_s:.0f}s"
                break
            time.sleep(poll_s)
        if reason != "Complete":
            self._stop_pods([p for p in pods if p.completion_index not in done])
            for pod in pods:
                if pod.completion_index not in done:
                    ctr = self.running[pod.name][container]
                    ctr.reload()
                    done[pod.completion_index] = Exited(pod, container, int(ctr.attrs["State"]["ExitCode"]),
                                                        ctr.logs().decode("utf-8", "replace"), ctr)
        result = JobResult(dict(sorted(done.items())), reason, time.monotonic() - started)
        if reason != "Complete":
            tails = "\n".join(
                f"--- pod {e.pod.name} (index {i}) exit {e.exit_code}:\n" + "\n".join(e.logs.splitlines()[-25:])
                for i, e in result.pods.items())
            raise JobFailed(f"Job {self.plan.job['metadata']['name']} failed: {reason}\n{tails}", result)
        return result

    def run_test_pods(self, timeout_s: float = 60.0) -> list[Exited]:
        """``helm test``: each test hook pod to completion; raises PodFailed when one fails."""
        out = []
        for pod in self.plan.test_pods:
            running = self.start_pod(pod)
            for name, ctr in running.items():
                code = int(ctr.wait(timeout=timeout_s)["StatusCode"])
                e = Exited(pod, name, code, ctr.logs().decode("utf-8", "replace"), ctr)
                out.append(e)
                if code != 0:
                    raise PodFailed(f"helm test pod {pod.name} exited {code}:\n{e.logs}")
        return out


def read_file(container: Any, path: str) -> bytes:
    """A file from a (possibly exited) container, through ``docker cp`` (get_archive)."""
    stream, _ = container.get_archive(path)
    data = io.BytesIO(b"".join(stream))
    with tarfile.open(fileobj=data) as tar:
        member = tar.next()
        assert member is not None and member.isfile(), f"{path}: not a file"
        f = tar.extractfile(member)
        assert f is not None
        return f.read()
