"""Init methods: a URL (``env://``, ``tcp://``, ``file://``) → ``(store, rank, world_size)``.

The same entry points and error texts as torch 2.13 (docs/torch-rules.md §1–2): ``rendezvous(url, rank=-1, world_size=-1, **kwargs)`` returns a generator whose first
``next()`` yields the triple and whose second raises; ``register_rendezvous_handler(scheme,
handler)`` adds a scheme. Handler errors are ``ValueError("Error initializing
torch.distributed using <scheme>:// rendezvous: <detail>")``, naming the missing variable or
parameter. Rank 0 hosts the TCPStore server for env:// and tcp://, as in torch.

**External master service** (distlib's addition, for a standing ``distlib store-server``):
when ``TORCHELASTIC_USE_AGENT_STORE=True`` (torch's variable, exact string as torch reads
it), or ``DISTLIB_EXTERNAL_STORE=1``, or the URL has ``external_store=1``, no rank hosts a
server: every rank, rank 0 included, is a client of ``MASTER_ADDR:MASTER_PORT`` (env://)
or the URL's host:port (tcp://). If ``TORCHELASTIC_RUN_ID`` or ``DISTLIB_RUN_ID`` is set,
the store handed back is ``PrefixStore("distlib/run/<id>", store)``, so that jobs sharing
one master service never see each other's keys; in a restarted elastic job
(``TORCHELASTIC_RESTART_COUNT`` N > 0) ``.../attempt_<N>``, so that each round's keys are its own
(the names: distlib/keyspace.py).

env:// reads who this process is from ``identity.Identity`` (torch's variables, and Slurm's
inside an ``srun`` step), which writes nothing into ``os.environ``.
"""

from __future__ import annotations

import logging
import numbers
import os
from datetime import timedelta
from typing import Callable, Dict, Iterator, Optional, Tuple
from urllib.parse import urlparse, urlunparse

from . import settings
from .identity import VARIABLES as IDENTITY_VARIABLES
from .identity import Identity, IdentityError
from .store.base import Store
from .store.prefix import PrefixStore

#: torch.distributed.default_pg_timeout: 30 minutes.
default_pg_timeout = timedelta(minutes=30)

RendezvousResult = Tuple[Store, int, int]
Handler = Callable[..., Iterator[RendezvousResult]]

_handlers: Dict[str, Handler] = {}
log = logging.getLogger("distlib.rendezvous")


def register_rendezvous_handler(scheme: str, handler: Handler) -> None:
    """Register a generator function ``handler(url, **kwargs)`` for ``scheme://`` URLs."""
    if scheme in _handlers:
        raise RuntimeError(f"Rendezvous handler for {scheme}:// already registered")
    _handlers[scheme] = handler


def rendezvous(url, rank: int = -1, world_size: int = -1, **kwargs) -> Iterator[RendezvousResult]:
    """Return the generator of ``(store, rank, world_size)`` for ``url`` (see module doc)."""
    if not isinstance(url, (str, bytes)):
        raise RuntimeError(f"`url` must be a string. {type(url)}: {url}")
    check_types(rank, world_size)
    if isinstance(url, bytes):
        url = url.decode("utf-8")
    return _rendezvous_helper(url, int(rank), int(world_size), **kwargs)


def check_types(rank, world_size) -> None:
    """torch's type checks of ``rank`` and ``world_size`` (RuntimeError, torch's texts)."""
    if not isinstance(rank, numbers.Integral):
        raise RuntimeError(f"`rank` must be an integer. {rank}")
    if not isinstance(world_size, numbers.Integral):
        raise RuntimeError(f"`world_size` must be an integer. {world_size}")


def _rendezvous_helper(url: str, rank: int, world_size: int, identity: Optional[Identity] = None,
                       **kwargs) -> Iterator[RendezvousResult]:
    result = urlparse(url)
    origins = {name: "argument" for name, value in (("rank", rank), ("world_size", world_size)) if value != -1}
    if rank != -1 or world_size != -1:
        query = _query_to_dict(result.query)
        if "rank" in query or "world_size" in query:
            raise AssertionError(f"The url: {url} has node-specific arguments(rank, world_size) already.")
        if rank != -1:
            query["rank"] = str(rank)
        if world_size != -1:
            query["world_size"] = str(world_size)
        result = result._replace(query="&".join(f"{k}={v}" for k, v in query.items()))
        url = urlunparse(result)
    if result.scheme not in _handlers:
        raise RuntimeError(f"No rendezvous handler for {result.scheme}://")
    handler = _handlers[result.scheme]
    if handler in _BUILTIN:  # a user's handler keeps torch's keyword arguments
        kwargs["origins"] = origins
        kwargs["identity"] = identity
    return handler(url, **kwargs)


def _query_to_dict(query: str) -> Dict[str, str]:
    """torch's parser: split on '&', each piece on '='; first two parts; no percent-decoding."""
    return {pair[0]: pair[1] for pair in (piece.split("=") for piece in filter(None, query.split("&")))}


def _rendezvous_error(msg: str) -> ValueError:
    return ValueError("Error initializing torch.distributed using " + msg)


def check_rank(rank: int, world_size: int, rank_from: str, size_from: str) -> None:
    """ValueError, before anything waits on the network, when ``rank`` and ``world_size`` cannot
    describe a group; ``*_from`` say where each value came from (the environment, an argument,
    the URL), since a launcher's environment is the usual culprit."""
    if world_size < 1:
        raise ValueError(f"the world size must be at least 1, but it is {world_size} ({size_from})")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} ({rank_from}) is outside [0, {world_size}) for world size {world_size} "
                         f"({size_from}): ranks go from 0 to {world_size - 1}")


def _origin(name: str, query: Dict[str, str], origins: Dict[str, str], identity: Identity) -> str:
    """Where a handler's ``name`` came from, in words (see check_rank): an argument, the URL, or
    the identity's source (the environment, Slurm's variables)."""
    if origins.get(name) == "argument":
        return f"{name}={query.get(name)}, from the {name}= argument"
    if name in query:
        return f"{name}={query[name]}, from the init_method URL"
    return identity.source(name) or f"{name}={getattr(identity, name)}"


def _checked(error: Callable[[str], ValueError], query: Dict[str, str], origins: Dict[str, str], rank: int,
             world_size: int, identity: Identity) -> None:
    try:
        check_rank(rank, world_size, _origin("rank", query, origins, identity),
                   _origin("world_size", query, origins, identity))
    except ValueError as exc:
        raise error(str(exc)) from None


def _use_libuv(query: Dict[str, str]) -> bool:
    return query.get("use_libuv", os.environ.get("USE_LIBUV", "1")) == "1"


def uses_external_store(query: Dict[str, str], identity: Identity) -> bool:
    """True when the store already runs as a master service (see the module docstring)."""
    return identity.external_store or settings.flag("external_store", False, query)


def create_c10d_store(hostname: str, port: int, rank: int, world_size: int, timeout: timedelta,
                      query: Dict[str, str], wait_for_workers: bool = True,
                      identity: Optional[Identity] = None) -> Store:
    """The TCPStore for env:// and tcp://: rank 0 hosts it, or nobody does (external service),
    and then the job's keys are under its run's and attempt's prefix (keyspace.py).

    ``wait_for_workers=False`` (what init_process_group asks for) lets rank 0 go on without
    counting the workers in the store: the group's join step waits for every rank anyway, and
    unlike the store's anonymous counter it can name the ranks that never came.
    """
    from .store.tcp.client import TCPStore

    identity = identity if identity is not None else Identity.read()
    if not 0 <= port < 2**16:
        raise ValueError(f"port must have value from 0 to 65535 but was {port}.")
    if uses_external_store(query, identity):
        store: Store = TCPStore(hostname, port, world_size, False, timeout, wait_for_workers=wait_for_workers)
        prefix = identity.keys.store_prefix()
        return PrefixStore(prefix, store) if prefix else store
    # A store that rank 0 hosts ends with rank 0's process, and nothing brings it back with its
    # keys: its clients fail when it goes, as torch's do, instead of waiting for it to return
    # (a master service is another matter: above). DISTLIB_STORE_RECONNECT_TIMEOUT still wins.
    reconnect = settings.store_reconnect_timeout()
    return TCPStore(hostname, port, world_size, rank == 0, timeout, wait_for_workers=wait_for_workers,
                    multi_tenant=True, use_libuv=_use_libuv(query), reconnect_timeout=reconnect or 0)


def _rank_and_world_size(query: Dict[str, str], error: Callable[[str], ValueError],
                         origins: Optional[Dict[str, str]]) -> Tuple[int, int]:
    """The rank and world size a tcp:// or file:// URL must carry in its query (torch's
    messages when one is missing), checked by ``_checked``."""
    if "rank" not in query:
        raise error("rank parameter missing")
    if "world_size" not in query:
        raise error("world size parameter missing")
    rank = int(query["rank"])
    world_size = int(query["world_size"])
    _checked(error, query, origins or {}, rank, world_size, Identity())
    return rank, world_size


def _tcp_rendezvous_handler(url: str, timeout: timedelta = default_pg_timeout, wait_for_workers: bool = True,
                            origins: Optional[Dict[str, str]] = None, identity: Optional[Identity] = None,
                            **kwargs):
    def error(msg: str) -> ValueError:
        return _rendezvous_error("tcp:// rendezvous: " + msg)

    result = urlparse(url)
    if not result.port:
        raise error("port number missing")
    query = _query_to_dict(result.query)
    rank, world_size = _rank_and_world_size(query, error, origins)
    assert result.hostname is not None, f"tcp:// URL without a host: {url}"
    store = create_c10d_store(result.hostname, result.port, rank, world_size, timeout, query, wait_for_workers,
                              identity)
    yield (store, rank, world_size)
    raise RuntimeError("Unable to perform re-rendezvous using tcp:// method")


def _env_rendezvous_handler(url: str, timeout: timedelta = default_pg_timeout, wait_for_workers: bool = True,
                            origins: Optional[Dict[str, str]] = None, identity: Optional[Identity] = None,
                            **kwargs):
    def error(msg: str) -> ValueError:
        return _rendezvous_error("env:// rendezvous: " + msg)

    query = _query_to_dict(urlparse(url).query)
    if identity is None:  # rendezvous() called directly: this process's identity, read now
        identity = Identity.read(os.environ, int(query["rank"]) if "rank" in query else -1,
                                 int(query["world_size"]) if "world_size" in query else -1)
    try:
        rank = int(query["rank"]) if "rank" in query else int(identity.need("rank"))  # type: ignore[arg-type]
        world_size = (int(query["world_size"]) if "world_size" in query
                      else int(identity.need("world_size")))  # type: ignore[arg-type]
        _checked(error, query, origins or {}, rank, world_size, identity)
        master_addr = str(identity.need("master_addr"))
        master_port = int(identity.need("master_port"))  # type: ignore[arg-type]
    except IdentityError as exc:
        raise error(str(exc)) from None
    if identity.from_slurm:
        log.info("env:// inside Slurm step %s.%s: %s", os.environ.get("SLURM_JOB_ID"), os.environ.get("SLURM_STEP_ID"),
                 ", ".join(f"{_SLURM_NAMES[name]}={getattr(identity, name)} (from {source})"
                           for name, source in identity.from_slurm.items()))
    store = create_c10d_store(master_addr, master_port, rank, world_size, timeout, query, wait_for_workers, identity)
    yield (store, rank, world_size)
    raise RuntimeError("Unable to perform re-rendezvous using env:// method")


#: The names the Slurm log line gives each field: torch's variables, which torchrun would set.
_SLURM_NAMES = {name: variable for name, variable, _ in IDENTITY_VARIABLES}
_SLURM_NAMES["run_id"] = "TORCHELASTIC_RUN_ID"


def _file_rendezvous_handler(url: str, origins: Optional[Dict[str, str]] = None, **kwargs):
    def error(msg: str) -> ValueError:
        return _rendezvous_error("file:// rendezvous: " + msg)

    from .store.file import FileStore

    result = urlparse(url)
    path = result.path
    if not path:
        raise error("path missing")
    query = _query_to_dict(result.query)
    rank, world_size = _rank_and_world_size(query, error, origins)
    store = FileStore(path, world_size)
    yield (store, rank, world_size)
    raise RuntimeError("Unable to perform rerendezvous using file:// method")


_BUILTIN = (_tcp_rendezvous_handler, _env_rendezvous_handler, _file_rendezvous_handler)

register_rendezvous_handler("tcp", _tcp_rendezvous_handler)
register_rendezvous_handler("env", _env_rendezvous_handler)
register_rendezvous_handler("file", _file_rendezvous_handler)
