"""What the jobs share: joining the default group from the environment, sizes, host facts.

The init method comes from ``DISTLIB_INIT_METHOD`` when it is set (the Helm chart's file mode
sets ``file:///shared/<run id>/store``; the Compose cluster's file mode the same), else
``env://`` (what ``distlib-run`` prepares: ``MASTER_ADDR``/``MASTER_PORT``/``RANK``/
``WORLD_SIZE``, and for the c10d backend ``TORCHELASTIC_USE_AGENT_STORE=True`` so that every
rank is a client of the master service). A ``file://`` URL without ``rank``/``world_size``
gets them from ``RANK``/``WORLD_SIZE``, and its directory is created first (FileStore refuses
a missing directory; on a fresh shared volume nobody else creates it).
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket
import sys
import time
from datetime import timedelta
from typing import Dict, Optional, Tuple
from urllib.parse import urlparse

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20,
          "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30}


def parse_size(text: str) -> int:
    """``4KiB``, ``4k``, ``1MiB``, ``16M``, ``4096`` → bytes (binary units)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (examples: 4KiB, 1MiB, 16MiB, 4096)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def parse_sizes(text: str):
    sizes = [parse_size(part) for part in text.split(",") if part.strip()]
    if any(s <= 0 for s in sizes):
        raise ValueError(f"sizes must be positive: {text!r}")
    return sizes


def format_size(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    if nbytes >= 1 << 20:
        return f"{nbytes / (1 << 20):.1f} MiB"
    if nbytes >= 1 << 10:
        return f"{nbytes / (1 << 10):.1f} KiB"
    return f"{nbytes} B"


def env_int(name: str) -> Optional[int]:
    value = os.environ.get(name, "").strip()
    return int(value) if value.lstrip("-").isdigit() else None


def init_method_from_env() -> str:
    return os.environ.get("DISTLIB_INIT_METHOD", "").strip() or "env://"


def prepare_file_url(url: str) -> Tuple[str, int, int]:
    """For a ``file://`` URL: create its directory; return (url, rank, world_size) where rank
    and world_size are -1 when the URL carries them, else taken from RANK/WORLD_SIZE."""
    parsed = urlparse(url)
    query = parsed.query
    if parsed.path:
        os.makedirs(os.path.dirname(parsed.path) or "/", exist_ok=True)
    rank = world = -1
    if "rank=" not in query:
        rank = env_int("RANK") if env_int("RANK") is not None else -1
    if "world_size=" not in query:
        world = env_int("WORLD_SIZE") if env_int("WORLD_SIZE") is not None else -1
    return url, rank, world


def join(backend: Optional[str], timeout_s: float) -> Tuple[str, float]:
    """init_process_group from the environment; returns (init method, seconds it took)."""
    import distlib as dist

    url = init_method_from_env()
    rank = world = -1
    if url.startswith("file://"):
        url, rank, world = prepare_file_url(url)
    started = time.monotonic()
    dist.init_process_group(backend or os.environ.get("DISTLIB_BACKEND", "gloo"), init_method=url,
                            timeout=timedelta(seconds=timeout_s), rank=rank, world_size=world)
    return url, time.monotonic() - started


def describe_init(url: str) -> str:
    """The init method in words, for the report."""
    if url.startswith("env://"):
        where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
        external = (os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
                    or os.environ.get("DISTLIB_EXTERNAL_STORE", "").lower() in ("1", "true", "yes"))
        return (f"env:// through the master service at {where}" if external
                else f"env:// with rank 0 hosting the store at {where}")
    if url.startswith("file://"):
        return f"file:// FileStore {urlparse(url).path}"
    return url


def dns_name(address: Optional[str]) -> str:
    """The name DNS gives ``address`` (Docker: the container's name, e.g. ``proj-worker-3``, from
    ``<container>.<network>``), or "-". Ask about a *peer's* address: for its own address a
    container's resolver answers from /etc/hosts with the bare host name."""
    if not address or address == "?":
        return "-"
    ip = address.rsplit(":", 1)[0].strip("[]") if address.count(":") == 1 or address.startswith("[") else address
    try:
        ipaddress.ip_address(ip)
        name = socket.gethostbyaddr(ip)[0]
    except (OSError, ValueError):
        return "-"
    return name.split(".", 1)[0] if not name[:1].isdigit() else name


def advertised_address(rank: int) -> Optional[str]:
    """``host:port`` this rank advertised to its peers (the gloo backend's published record)."""
    try:
        from distlib.distributed import get_default_group

        pg = get_default_group()
        for backend in pg.backends.values():
            records = getattr(backend, "records", None)
            if records:
                host, port = records[rank]["addresses"][0]
                return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"
    except Exception:  # noqa: BLE001 - the report says "?" instead
        return None
    return None


def host_facts(rank: int, init_s: float) -> Dict[str, object]:
    address = advertised_address(rank)
    return {
        "rank": rank,
        "local_rank": env_int("LOCAL_RANK") or 0,
        "node_rank": env_int("GROUP_RANK") if env_int("GROUP_RANK") is not None else rank,
        "host": socket.gethostname(),
        "address": address or "?",
        "pid": os.getpid(),
        "init_s": init_s,
    }


def error_name(exc: BaseException) -> str:
    """The public name of an error: ``DistBackendError`` rather than a private subclass."""
    for cls in type(exc).__mro__:
        if not cls.__name__.startswith("_"):
            return cls.__name__
    return type(exc).__name__


def table(header, rows) -> str:
    rows = [[str(c) for c in row] for row in rows]
    widths = [max(len(x) for x in col) for col in zip(header, *rows)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = [fmt.format(*header), fmt.format(*("-" * w for w in widths))] + [fmt.format(*r) for r in rows]
    return "\n".join(line.rstrip() for line in lines)


def say(text: str, stream=None) -> None:
    """Print whole lines in one write (ranks of one node share stdout)."""
    stream = stream or sys.stdout
    stream.write(text if text.endswith("\n") else text + "\n")
    stream.flush()
