"""``distlib gpu-info``: what this machine (or container) offers the nccl backend, one line per
fact: the cupy, CUDA runtime, NVRTC and NCCL versions found, then the CUDA devices, or why none
is visible. It is the GPU image's default command, and what ``GPU=1 make cluster-up`` runs in a
probe container before it starts a GPU cluster.

Exit status 0 when cupy, NCCL and at least one device are usable; 1 otherwise (the reason is
the last line). ``--check`` also runs, on every device, an elementwise kernel (NVRTC) and a
one-rank NCCL all_reduce, so a first run on a new GPU machine shows that everything loads.
``--json`` writes the same facts for machines (the cluster's probe reads it).

Nothing here initialises CUDA before it is asked to: the versions come from the libraries, and
the device count is the first call that talks to the driver.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Dict, List, Optional

from . import command

PROG = "distlib gpu-info"
#: Elements of the --check arrays: enough to launch more than one block, small enough for any GPU.
CHECK_ELEMENTS = 1 << 16


def nccl_version_text(code: int) -> str:
    """NCCL's version code as text: 23203 -> 2.32.3 (from 2.9 on the code is
    major*10000 + minor*100 + patch; before, major*1000 + minor*100 + patch)."""
    if code >= 20900:
        return f"{code // 10000}.{code % 10000 // 100}.{code % 100}"
    return f"{code // 1000}.{code % 1000 // 100}.{code % 100}"


def cuda_version_text(code: int) -> str:
    """A CUDA version code as text: 12090 -> 12.9 (major*1000 + minor*10)."""
    return f"{code // 1000}.{code % 1000 // 10}"


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace").rstrip("\0") if isinstance(value, bytes) else str(value)


def device_line(index: int, props: Dict[str, Any]) -> str:
    """One device as ``cudaGetDeviceProperties`` describes it (cupy's dict of it)."""
    name = _text(props.get("name", "?"))
    memory = props.get("totalGlobalMem", 0) / (1 << 30)
    bus = f"{props.get('pciDomainID', 0):04x}:{props.get('pciBusID', 0):02x}:{props.get('pciDeviceID', 0):02x}.0"
    return (f"cuda:{index} {name}, compute capability {props.get('major', '?')}.{props.get('minor', '?')}, "
            f"{memory:.1f} GiB, PCI {bus}")


def libraries() -> Dict[str, Any]:
    """The versions of cupy and the CUDA libraries it loads, without touching a device; a
    ``problem`` when cupy or its NCCL is missing."""
    from distlib.backends import cupy_env

    facts: Dict[str, Any] = {"cupy": None, "cuda_runtime": None, "nvrtc": None, "nccl": None, "problem": ""}
    try:
        import cupy
    except ImportError:
        facts["problem"] = cupy_env.status().problem
        return facts
    facts["cupy"] = cupy.__version__
    from cupy.cuda import nvrtc, runtime

    facts["cuda_runtime"] = cuda_version_text(runtime.runtimeGetVersion())
    try:
        facts["nvrtc"] = "%d.%d" % nvrtc.getVersion()
    except Exception as exc:  # noqa: BLE001 - NVRTC's library missing: said, not raised
        facts["nvrtc"] = f"not found ({type(exc).__name__}: {exc})"
    status = cupy_env.status()
    if status.nccl is None:
        facts["problem"] = status.problem
    else:
        facts["nccl"] = nccl_version_text(status.nccl.get_version())
    return facts


def devices() -> Dict[str, Any]:
    """The driver and the visible devices; ``problem`` says why none is usable."""
    from distlib.backends import cupy_env

    status = cupy_env.status()
    found: Dict[str, Any] = {"driver": None, "devices": [], "problem": ""}
    if status.devices == 0:
        found["problem"] = status.problem.replace("no CUDA device (", "no CUDA device visible (", 1)
        return found
    runtime = status.cupy.cuda.runtime
    found["driver"] = cuda_version_text(runtime.driverGetVersion())
    for index in range(status.devices):
        found["devices"].append(device_line(index, runtime.getDeviceProperties(index)))
    return found


def check_device(index: int) -> str:
    """An elementwise kernel (compiled by NVRTC) and a one-rank NCCL all_reduce on ``index``;
    "ok" or what failed."""
    import cupy
    import numpy
    from cupy.cuda import nccl

    try:
        with cupy.cuda.Device(index):
            x = cupy.arange(CHECK_ELEMENTS, dtype=cupy.float32)
            y = x * 2 + 1  # an elementwise kernel: NVRTC compiles it for this device
            expected = numpy.arange(CHECK_ELEMENTS, dtype=numpy.float32) * 2 + 1  # exact below 2**24
            if not numpy.array_equal(cupy.asnumpy(y), expected):
                return "the elementwise kernel computed wrong values"
            comm = nccl.NcclCommunicator(1, nccl.get_unique_id(), 0)
            try:
                out = cupy.empty_like(y)
                stream = cupy.cuda.Stream(non_blocking=True)
                comm.allReduce(y.data.ptr, out.data.ptr, y.size, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, stream.ptr)
                stream.synchronize()
            finally:
                comm.destroy()
            if not numpy.array_equal(cupy.asnumpy(out), expected):
                return "a one-rank NCCL all_reduce changed the data"
    except Exception as exc:  # noqa: BLE001 - the first run on a new machine: say what broke
        return f"{type(exc).__name__}: {' '.join(str(exc).split())}"
    return "ok"


def report(check: bool) -> Dict[str, Any]:
    """Everything ``gpu-info`` prints, as data; ``ok`` is the exit status's meaning."""
    out = libraries()
    out.update(driver=None, devices=[], checks=[])
    if out["problem"]:
        out["ok"] = False
        return out
    found = devices()
    out.update(driver=found["driver"], devices=found["devices"], problem=found["problem"])
    if check and not out["problem"]:
        out["checks"] = [check_device(i) for i in range(len(out["devices"]))]
        bad = [f"cuda:{i}: {c}" for i, c in enumerate(out["checks"]) if c != "ok"]
        if bad:
            out["problem"] = "check failed on " + "; ".join(bad)
    out["ok"] = not out["problem"] and bool(out["devices"])
    return out


def lines(facts: Dict[str, Any]) -> List[str]:
    """The report as text, one line per fact."""
    if facts["cupy"] is None:
        return [facts["problem"]]
    head = f"cupy {facts['cupy']} (CUDA runtime {facts['cuda_runtime']}, NVRTC {facts['nvrtc']})"
    if facts["nccl"] is None:
        return [head, facts["problem"]]
    out = [f"{head}, NCCL {facts['nccl']}"]
    if facts["devices"]:
        out.append(f"CUDA driver {facts['driver']}, {len(facts['devices'])} device(s):")
        checks = facts.get("checks") or []
        for i, text in enumerate(facts["devices"]):
            out.append(text + (f": kernel and NCCL all_reduce {checks[i]}" if i < len(checks) else ""))
    if facts["problem"]:
        out.append(facts["problem"])
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true",
                   help="also run an elementwise kernel and a one-rank NCCL all_reduce on every device")
    command.add_json(p, "the facts")
    command.add_log_level(p)
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)

    def body() -> int:
        facts = report(args.check)
        out = command.text_stream(args.json)
        print("\n".join(lines(facts)), file=out, flush=True)
        if args.json:
            command.write_json(args.json, facts)
        return 0 if facts["ok"] else 1

    return command.run(PROG, body)


if __name__ == "__main__":
    sys.exit(main())
