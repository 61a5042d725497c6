"""GPU=1: whether the Docker engine can give the workers NVIDIA GPUs, and how many, asked before
anything of the cluster is created.

Two checks, in this order:

1. before the image is built, the engine's own description (``docker info``): Docker hands out
   GPUs through the NVIDIA Container Toolkit, which registers an ``nvidia`` runtime (what the
   toolkit's ``nvidia-ctk runtime configure --runtime=docker`` does) or, on engines with CDI
   device discovery, lists devices ``nvidia.com/gpu=...``. A host with neither cannot run a GPU
   worker, and says so in one line without a minute spent building;
2. after the build, the question itself: one throw-away container of the image, with exactly
   the workers' request (driver nvidia, all GPUs), runs ``distlib gpu-info --check`` and tells
   how many devices it sees and whether a kernel and NCCL run on them. The daemon's own refusal
   (``could not select device driver "nvidia"``: the toolkit's hook is not on its PATH) and the
   toolkit's (no driver on the host) come back as that one line too.
"""

from __future__ import annotations

import json
from typing import Any, Dict, Mapping, Optional

from distlib.command import ToolError

NVIDIA_RUNTIME = "nvidia"
CDI_NVIDIA_GPU = "nvidia.com/gpu="
#: Seconds the probe container may take (starting it, importing cupy, one kernel and NCCL per GPU).
PROBE_TIMEOUT_S = 180
TOOLKIT_HINT = ("install the NVIDIA Container Toolkit on the Docker host and run `nvidia-ctk runtime configure "
                "--runtime=docker` (then restart dockerd), or run without GPU=1")


def engine_gpu_problem(info: Mapping[str, Any], where: str) -> Optional[str]:
    """None when ``docker info`` shows the NVIDIA Container Toolkit; else the sentence why the
    workers could not get a GPU from this engine."""
    runtimes = sorted((info.get("Runtimes") or {}).keys())
    if NVIDIA_RUNTIME in runtimes:
        return None
    cdi = [str(d.get("ID", "")) for d in info.get("DiscoveredDevices") or [] if isinstance(d, Mapping)]
    if any(d.startswith(CDI_NVIDIA_GPU) for d in cdi):
        return None
    seen = f"runtimes {', '.join(runtimes) or 'none'}; CDI devices {', '.join(cdi) or 'none'}"
    return (f"GPU=1 needs NVIDIA GPUs through the Docker engine, and the one at {where} has no NVIDIA Container "
            f"Toolkit: `docker info` lists no nvidia runtime and no CDI device nvidia.com/gpu=... ({seen}); "
            f"{TOOLKIT_HINT}")


def probe(client, image: str, labels: Dict[str, str]) -> Dict[str, Any]:
    """``distlib gpu-info --check`` in a container of ``image`` with the workers' GPU request;
    its facts (``devices``, ``ok``, ``problem``, versions). ToolError, in one line, when the
    engine refuses the request or the container says nothing usable."""
    import docker

    request = docker.types.DeviceRequest(driver="nvidia", count=-1, capabilities=[["gpu"]])
    container = client.containers.create(image, ["distlib", "gpu-info", "--check", "--json", "-"],
                                         device_requests=[request], network_mode="none", labels=labels)
    try:
        try:
            container.start()
        except docker.errors.APIError as exc:
            why = " ".join(str(exc.explanation or exc).split())
            raise ToolError(f"GPU=1: the Docker engine refused a container with the workers' GPU request (driver "
                            f"nvidia, all GPUs): {why}; {TOOLKIT_HINT}") from None
        try:
            status = container.wait(timeout=PROBE_TIMEOUT_S).get("StatusCode")
        except Exception:  # noqa: BLE001 - requests' ReadTimeout, or the engine went away
            raise ToolError(f"GPU=1: `distlib gpu-info --check` in a container of {image} did not finish within "
                            f"{PROBE_TIMEOUT_S} s") from None
        out = container.logs(stdout=True, stderr=False).decode("utf-8", "replace")
        said = container.logs(stdout=False, stderr=True).decode("utf-8", "replace").strip().splitlines()
    finally:
        try:
            container.remove(force=True)
        except docker.errors.APIError:
            pass
    try:
        facts = json.loads(out)
    except ValueError:
        last = said[-1] if said else f"exit status {status}, no output"
        raise ToolError(f"GPU=1: `distlib gpu-info` in a container of {image} failed: {last}") from None
    return facts


def require(facts: Mapping[str, Any], image: str, nodes: int, per_node: int) -> int:
    """The number of GPUs the probe found, when the cluster fits on them; else ToolError."""
    found = len(facts.get("devices") or [])
    if not facts.get("ok"):
        raise ToolError(f"GPU=1: a container of {image} with the workers' GPU request (driver nvidia, all GPUs) "
                        f"cannot use a GPU: {facts.get('problem') or 'no device'}")
    need = nodes * per_node
    if found < need:
        raise ToolError(f"GPU=1: NODES={nodes} x NPROC_PER_NODE={per_node} needs {need} GPUs (one per process, no "
                        f"two workers sharing one), and the Docker host gives containers {found}: lower NODES or "
                        f"NPROC_PER_NODE")
    return found
