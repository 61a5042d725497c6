"""Store chains: a ``PrefixStore`` (or any wrapper with ``underlying_store``) over the store that
holds the keys, and the two questions every owner of a chain asks, answered once.

* ``innermost(store)``: the store at the end of the chain (the TCPStore whose socket it is,
  the FileStore whose file it is): what two chains share when they share a connection.
* ``close_quietly(store)``: close the store at the end of the chain, if it can be closed,
  when its owner lets it go (a teardown, a client given up after a failure); a failure to
  close is logged, never raised, since the owner is already on its way out.
"""

from __future__ import annotations

import logging

from ..errors import DistError
from .base import Store

log = logging.getLogger("distlib.store")


def innermost(store: Store) -> Store:
    """The store at the end of ``store``'s chain of wrappers (``store`` itself if it wraps none)."""
    while getattr(store, "underlying_store", None) is not None:
        store = store.underlying_store  # type: ignore[attr-defined]
    return store


def close_quietly(store: object) -> None:
    """Close the store at the end of ``store``'s chain if it has ``close`` (None: nothing)."""
    if store is None:
        return
    inner = innermost(store)  # type: ignore[arg-type]
    close = getattr(inner, "close", None)
    if not callable(close):
        return
    try:
        close()
    except (DistError, OSError) as exc:
        log.debug("closing %s failed: %s", inner.describe() if isinstance(inner, Store) else inner, exc)
