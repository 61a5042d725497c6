"""``HashStore``: an in-process store (a dict under one lock), as torch's HashStore.

Useful for tests and for threads of one process. Behaviour follows torch 2.13's HashStore
(keys stored raw, ``num_keys`` counts user keys only, ``clone()`` returns the same object,
queues are supported) with one fix: torch's ``add`` does not wake waiters, so a ``wait`` on
a key created by ``add`` only notices at its deadline (observed: "woke after 3.00 s" with a
3 s timeout). Here every write wakes waiters.
"""

from __future__ import annotations

import collections
import threading
from typing import Deque, Dict, List, Optional

from ..deadline import TimeoutLike
from ..errors import QueueEmptyError
from .base import (
    DEFAULT_STORE_TIMEOUT,
    Store,
    ValueLike,
    check_key,
    add_to_counter,
    check_keys,
    compare_set_refusal,
    to_bytes,
)


class HashStore(Store):
    """A thread-safe in-memory store: ``HashStore()``."""

    def __init__(self) -> None:
        super().__init__(DEFAULT_STORE_TIMEOUT)
        self._data: Dict[str, bytes] = {}
        self._queues: Dict[str, Deque[bytes]] = {}
        self._cond = threading.Condition()

    def describe(self) -> str:
        return "HashStore (this process)"

    # -- core ----------------------------------------------------------------------------------

    def set(self, key: str, value: ValueLike) -> None:
        check_key(key)
        data = to_bytes(value)
        with self._cond:
            self._data[key] = data
            self._cond.notify_all()

    def get(self, key: str) -> bytes:
        check_key(key)
        self._wait_for([key], None)
        with self._cond:
            return self._data[key]

    def add(self, key: str, amount: int) -> int:
        check_key(key)
        amount = int(amount)
        with self._cond:
            value = add_to_counter(self._data.get(key), amount, key)
            self._data[key] = b"%d" % value
            self._cond.notify_all()
            return value

    def compare_set(self, key: str, expected_value: ValueLike, desired_value: ValueLike) -> bytes:
        check_key(key)
        expected = to_bytes(expected_value, "expected_value")
        desired = to_bytes(desired_value, "desired_value")
        with self._cond:
            refused = compare_set_refusal(self._data.get(key), expected, desired)
            if refused is not None:
                return refused
            self._data[key] = desired
            self._cond.notify_all()
            return desired

    def check(self, keys: List[str]) -> bool:
        keys = check_keys(keys)
        with self._cond:
            return all(self._present(k) for k in keys)

    def wait(self, keys: List[str], timeout: Optional[TimeoutLike] = None) -> None:
        self._wait_for(check_keys(keys), timeout)

    def delete_key(self, key: str) -> bool:
        check_key(key)
        with self._cond:
            return self._data.pop(key, None) is not None

    def num_keys(self) -> int:
        with self._cond:
            return len(self._data)

    # -- extended ------------------------------------------------------------------------------

    def has_extended_api(self) -> bool:
        return True

    def append(self, key: str, value: ValueLike) -> None:
        check_key(key)
        data = to_bytes(value)
        with self._cond:
            self._data[key] = self._data.get(key, b"") + data
            self._cond.notify_all()

    def multi_get(self, keys: List[str]) -> List[bytes]:
        keys = check_keys(keys)
        self._wait_for(keys, None)
        with self._cond:
            return [self._data[k] for k in keys]

    def multi_set(self, keys: List[str], values: List[ValueLike]) -> None:
        keys = check_keys(keys)
        values = list(values)
        if len(keys) != len(values):
            super().multi_set(keys, values)  # raises the length error
        encoded = [to_bytes(v) for v in values]
        with self._cond:
            self._data.update(zip(keys, encoded, strict=True))
            self._cond.notify_all()

    def queue_push(self, key: str, value: ValueLike) -> None:
        check_key(key)
        data = to_bytes(value)
        with self._cond:
            self._queues.setdefault(key, collections.deque()).append(data)
            self._cond.notify_all()

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        check_key(key)
        if block:
            self._wait_for([key], None, queues_only=True)
        with self._cond:
            queue = self._queues.get(key)
            if not queue:
                raise QueueEmptyError("queue is empty")
            return queue.popleft()

    def queue_len(self, key: str) -> int:
        check_key(key)
        with self._cond:
            return len(self._queues.get(key, ()))

    def list_keys(self) -> List[str]:
        with self._cond:
            return list(self._data)

    def clone(self) -> "HashStore":
        """The same object, as in torch: a HashStore is already shared by its threads."""
        return self

    # -- waiting -------------------------------------------------------------------------------

    def _present(self, key: str) -> bool:
        return key in self._data or bool(self._queues.get(key))

    def _wait_for(self, keys: List[str], timeout: Optional[TimeoutLike], queues_only: bool = False) -> None:
        deadline = self._deadline(timeout)

        def ready() -> bool:
            if queues_only:
                return all(self._queues.get(k) for k in keys)
            return all(self._present(k) for k in keys)

        with self._cond:
            while not ready():
                left = deadline.remaining()
                if left <= 0:
                    missing = [k for k in keys if not self._present(k)]
                    raise self.wait_timeout_error(missing or keys, deadline.seconds)
                self._cond.wait(left)
