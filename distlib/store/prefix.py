"""``PrefixStore(prefix, store)``: a namespace inside another store, as torch's PrefixStore.

Every key becomes ``prefix + "/" + key`` — always with the slash, even when the prefix is
empty or already ends in ``/`` (torch's process groups rely on the resulting ``//``; see
docs/wire-protocol.md, "PrefixStore keys"). Nesting composes from the outside in:
``PrefixStore("b", PrefixStore("a", s)).set("k", v)`` writes ``a/b/k``.

Forwarded unchanged (not filtered by prefix), as in torch: ``num_keys``, ``timeout``,
``set_timeout``, ``has_extended_api``. ``barrier`` is the generic add + wait over joined
keys. ``list_keys`` keeps torch's rule: underlying keys that start with the prefix, with
``len(prefix) + 1`` characters removed.
"""

from __future__ import annotations

from datetime import timedelta
from typing import List, Optional

from ..deadline import TimeoutLike
from .base import Store, ValueLike, check_key, check_keys


class PrefixStore(Store):
    def __init__(self, prefix: str, store: Store):
        if store is None:
            raise ValueError("store argument cannot be None")
        if not isinstance(prefix, str):
            raise TypeError(f"prefix must be str, got {type(prefix).__name__}")
        if not isinstance(store, Store):
            raise TypeError(f"store must be a distlib Store, got {type(store).__name__}")
        # No timeout of its own: timeout/set_timeout forward to the underlying store.
        self._prefix = prefix
        self._store = store

    # -- naming --------------------------------------------------------------------------------

    @property
    def prefix(self) -> str:
        return self._prefix

    @property
    def underlying_store(self) -> Store:
        """The store one level down."""
        return self._store

    @property
    def _underlying_non_prefix_store(self) -> Store:
        """The first store below that is not a PrefixStore."""
        store = self._store
        while isinstance(store, PrefixStore):
            store = store._store
        return store

    def _join(self, key: str) -> str:
        return self._prefix + "/" + check_key(key)

    def _join_all(self, keys: List[str]) -> List[str]:
        return [self._prefix + "/" + k for k in check_keys(keys)]

    def describe(self) -> str:
        """The store below every prefix, and the one prefix all of this store's keys carry
        (nested PrefixStores read as one: ``TCPStore server m:29500, keys under 'a/b/'``)."""
        full = self._prefix + "/"
        store = self._store
        while isinstance(store, PrefixStore):
            full = store._prefix + "/" + full
            store = store._store
        return f"{store.describe()}, keys under {full!r}"

    # -- timeout forwards ----------------------------------------------------------------------

    @property
    def timeout(self) -> timedelta:
        return self._store.timeout

    def set_timeout(self, timeout: TimeoutLike) -> None:
        self._store.set_timeout(timeout)

    # -- forwarded operations ------------------------------------------------------------------

    def set(self, key: str, value: ValueLike) -> None:
        self._store.set(self._join(key), value)

    def get(self, key: str) -> bytes:
        return self._store.get(self._join(key))

    def add(self, key: str, amount: int) -> int:
        return self._store.add(self._join(key), amount)

    def compare_set(self, key: str, expected_value: ValueLike, desired_value: ValueLike) -> bytes:
        return self._store.compare_set(self._join(key), expected_value, desired_value)

    def check(self, keys: List[str]) -> bool:
        return self._store.check(self._join_all(keys))

    def wait(self, keys: List[str], timeout: Optional[TimeoutLike] = None) -> None:
        self._store.wait(self._join_all(keys), timeout)

    def delete_key(self, key: str) -> bool:
        return self._store.delete_key(self._join(key))

    def num_keys(self) -> int:
        return self._store.num_keys()

    def has_extended_api(self) -> bool:
        return self._store.has_extended_api()

    def append(self, key: str, value: ValueLike) -> None:
        self._store.append(self._join(key), value)

    def multi_get(self, keys: List[str]) -> List[bytes]:
        return self._store.multi_get(self._join_all(keys))

    def multi_set(self, keys: List[str], values: List[ValueLike]) -> None:
        self._store.multi_set(self._join_all(keys), values)

    def queue_push(self, key: str, value: ValueLike) -> None:
        self._store.queue_push(self._join(key), value)

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        return self._store.queue_pop(self._join(key), block)

    def queue_len(self, key: str) -> int:
        return self._store.queue_len(self._join(key))

    def list_keys(self) -> List[str]:
        cut = len(self._prefix) + 1
        return [k[cut:] for k in self._store.list_keys() if k.startswith(self._prefix)]

    def clone(self) -> "PrefixStore":
        return PrefixStore(self._prefix, self._store.clone())

    def __repr__(self) -> str:
        return f"PrefixStore(prefix={self._prefix!r}, store={self._store!r})"
