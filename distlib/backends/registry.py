"""``Backend``: backend names as torch spells them, the device → backend parsing, and plugins.

``Backend`` is a str subclass (``Backend("GLOO") == "gloo"``), with torch 2.13's rules
(docs/torch-rules.md §4): a known name maps to every device it supports
(``gloo`` → ``cpu:gloo,cuda:gloo``), ``"cpu:gloo,cuda:nccl"`` is parsed pair by pair with
torch's error texts, and ``Backend.register_backend(name, func, extended_api=False,
devices=None)`` adds a third-party backend. A creator gets ``(store, group_rank,
group_size, timeout)`` (or, with ``extended_api=True``, ``(options, pg_options)``) and returns
a backend of one of the two kinds of backends/base.py: ``distlib.CommBackend`` (host-synchronous)
or ``distlib.StreamOrderedBackend``.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Union


@dataclass
class Plugin:
    """A third-party backend as ``Backend.register_backend`` recorded it: its creator and
    whether that takes torch's extended arguments (one options object)."""

    creator_fn: Callable
    extended_api: bool


class Backend(str):
    """A backend name: ``Backend("GLOO") == Backend.GLOO == "gloo"``."""

    UNDEFINED = "undefined"
    GLOO = "gloo"
    NCCL = "nccl"
    UCC = "ucc"
    MPI = "mpi"
    XCCL = "xccl"
    FAKE = "fake"

    backend_list: List[str] = ["undefined", "gloo", "nccl", "xccl", "ucc", "mpi", "fake"]
    default_device_backend_map: Dict[str, str] = {"cpu": "gloo", "cuda": "nccl", "xpu": "xccl", "mps": "gloo"}
    backend_capability: Dict[str, List[str]] = {
        "gloo": ["cpu", "cuda"], "nccl": ["cuda"], "xccl": ["xpu"], "ucc": ["cpu", "cuda"],
        "mpi": ["cpu", "cuda"], "fake": ["cpu", "cuda", "hpu", "xpu"],
    }
    _plugins: Dict[str, Plugin] = {}

    def __new__(cls, name: str) -> "Backend":
        if not isinstance(name, str):
            raise ValueError("Backend constructor parameter must be string-ish")
        value = getattr(Backend, name.upper(), None)
        return str.__new__(cls, value if isinstance(value, str) else name.lower())

    @classmethod
    def plugin(cls, name: str) -> Optional[Plugin]:
        """The third-party backend registered under ``name`` (any case), or None."""
        return cls._plugins.get(name.upper())

    @classmethod
    def register_backend(cls, name: str, func: Callable, extended_api: bool = False,
                         devices: Optional[Union[str, List[str]]] = None) -> None:
        """Register a third-party backend ``name`` created by ``func`` (see module doc)."""
        lower = name.lower()
        if not hasattr(Backend, name.upper()):
            setattr(Backend, name.upper(), lower)
        if lower not in Backend.backend_list:
            Backend.backend_list.append(lower)
        if devices is None:
            warnings.warn(f"Device capability of {name} unspecified, assuming `cpu` and `cuda`. "
                          f"Please specify it via the `devices` argument of `register_backend`.",
                          stacklevel=2)  # at the caller of register_backend
            Backend.backend_capability[lower] = ["cpu", "cuda"]
        elif isinstance(devices, str):
            Backend.backend_capability[lower] = [devices]
            if Backend.default_device_backend_map.get(devices) in (None, "fake"):
                Backend.default_device_backend_map[devices] = lower
        else:
            Backend.backend_capability[lower] = list(devices)
            for device in devices:
                if Backend.default_device_backend_map.get(device) in (None, "fake"):
                    Backend.default_device_backend_map[device] = lower
        Backend._plugins[name.upper()] = Plugin(func, extended_api)


def backend_config(backend: str, available_devices: List[str]) -> Dict[str, str]:
    """device → backend name for ``backend`` (torch's BackendConfig, §7.2)."""
    backend = Backend(backend)
    if backend == Backend.UNDEFINED:
        return {device: Backend.default_device_backend_map[device] for device in available_devices
                if device in Backend.default_device_backend_map}
    if ":" not in backend:
        if backend in Backend.backend_capability:
            return {device: str(backend) for device in Backend.backend_capability[backend]}
        # at the caller of init_process_group or new_group (through distributed._config_for)
        warnings.warn(f"Device capability of {backend} unknown, assuming `cpu` and `cuda`.", stacklevel=4)
        return {"cpu": str(backend), "cuda": str(backend)}
    result: Dict[str, str] = {}
    for piece in backend.lower().split(","):
        parts = piece.split(":")
        if len(parts) != 2:
            raise ValueError(
                f"Invalid device:backend pairing: {piece}. The custom backend string argument is invalid: "
                f"{backend}. Custom backend string is an experimental feature where the backend string must "
                f"be in the format: \"<device_type1>:<backend1>,<device_type2>:<backend2>...\". e.g. "
                f"'cpu:gloo,cuda:nccl'")
        device, name = parts
        if device in result:
            raise ValueError(
                f"Duplicate device type {device} in backend string: {backend}. The custom backend string "
                f"argument is invalid: {backend}.")
        result[device] = name
    return result


def config_string(config: Dict[str, str]) -> str:
    return ",".join(f"{device}:{name}" for device, name in config.items())
