"""The reason GPU tests skip: no CUDA device, and what cupy said about it."""


def no_device_reason():
    """None where cupy, its NCCL and a device are all here; else "no CUDA device (cupy: ...)"."""
    from distlib.backends import cupy_env

    status = cupy_env.status()
    if status.usable:
        return None
    if status.problem.startswith("no CUDA device"):
        return status.problem
    return f"no CUDA device (cupy: {status.problem})"

