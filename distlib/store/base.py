"""``Store``: the key-value interface every store implements, with torch.distributed's API.

A store is how ranks find each other: rank 0 (or a master service) holds a small key-value
table, and every rank sets, reads, counts and waits on keys in it. The names, arguments,
return types and exceptions are torch 2.x's (``torch.distributed.Store``):

=====================  ==================================================================
``set(k, v)``          v is str (encoded as UTF-8) or bytes
``get(k)``             bytes; blocks until k exists or the store timeout passes
``add(k, n)``          int; the value is kept as decimal ASCII, an absent key counts as 0
``compare_set``        bytes; torch's four cases (see ``compare_set``)
``check(keys)``        bool; True iff every key exists; never blocks
``wait(keys[, t])``    blocks until every key exists, or raises DistStoreError after t
``delete_key(k)``      bool
``num_keys()``         int (what it counts is store specific, as in torch)
``append``, ``multi_get``, ``multi_set``, ``has_extended_api``, ``queue_*``,
``list_keys``, ``barrier``, ``clone``, ``timeout`` / ``set_timeout``
=====================  ==================================================================

Subclasses implement the core operations; this base gives the generic forms torch's C++
``Store`` gives (append as a compare_set loop, multi_get/multi_set as loops, barrier as
add + wait), so a store without native support still offers the whole API.

Differences from torch, on purpose (docs/stores.md): a zero timeout means "do not wait" for
every store (torch's FileStore and HashStore read it as "forever"), and every timeout error
names the keys, the time waited and the store it waited on.
"""

from __future__ import annotations

import abc
from datetime import timedelta
from typing import Iterable, List, Optional, Sequence, Union

from ..deadline import Deadline, TimeoutLike, as_seconds, format_duration
from ..errors import DistStoreError

#: torch's default for every store object (TCPStore, FileStore, HashStore): 300 s.
DEFAULT_STORE_TIMEOUT = timedelta(seconds=300)

ValueLike = Union[str, bytes, bytearray, memoryview]


def to_bytes(value: ValueLike, what: str = "value") -> bytes:
    """Encode a store value: str as UTF-8, bytes-like as is."""
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    raise TypeError(f"store {what} must be str or bytes, got {type(value).__name__}")


def check_key(key: str) -> str:
    """Keys are str, as in torch (its bindings reject anything else)."""
    if not isinstance(key, str):
        raise TypeError(f"store key must be str, got {type(key).__name__}: {key!r}")
    return key


def check_keys(keys: Iterable[str]) -> List[str]:
    if isinstance(keys, (str, bytes)):
        raise TypeError("store keys must be a list of str, not a single string")
    return [check_key(k) for k in keys]


def parse_counter(raw: bytes, key: str) -> int:
    """Parse a stored counter the way torch's servers do (C ``strtoll`` rules).

    Leading whitespace is skipped, an optional sign and digits are read, trailing garbage is
    ignored (``b" 12 "`` → 12, ``b"5abc"`` → 5). No digits at all is an error; torch raises
    ``ValueError("stoll")`` there and distlib says which key held what.
    """
    text = raw.lstrip(b" \t\n\r\f\v")
    end = 0
    if text[:1] in (b"+", b"-"):
        end = 1
    start_digits = end
    while end < len(text) and 48 <= text[end] <= 57:
        end += 1
    if end == start_digits:
        raise ValueError(f"stoll: the value of key {key!r} is not an integer: {bytes(raw[:64])!r}")
    number = int(text[:end])
    if not -(2**63) <= number < 2**63:
        raise IndexError(f"stoll: the value of key {key!r} is out of the int64 range")
    return number


INT64_MAX = (1 << 63) - 1
INT64_MIN = -(1 << 63)


def wrap_int64(number: int) -> int:
    """Two's complement wrap-around, as torch's servers add (2**62 + 2**62 → -2**63)."""
    return (number + 2**63) % 2**64 - 2**63


def describe_key(key: bytes) -> str:
    """A stored key for log lines and errors: text when it is text, escaped bytes otherwise."""
    try:
        text = key.decode("utf-8")
    except UnicodeDecodeError:
        return repr(key)
    return text if text.isprintable() else repr(key)


def add_to_counter(old: Optional[bytes], amount: int, key: Union[str, bytes]) -> int:
    """ADD's arithmetic, the same in every store: the stored value ``old`` (None: absent,
    counts as 0; else C ``strtoll`` rules) plus ``amount``, wrapped to int64. The caller
    stores the result as decimal ASCII (``b"%d"``). ValueError / IndexError (from
    ``parse_counter``, naming ``key``) when ``old`` is not a number."""
    if old is None:
        number = amount
    elif old.isdigit() and len(old) < 19:  # the usual case: a counter a store wrote
        number = int(old) + amount
    else:
        number = parse_counter(old, key if isinstance(key, str) else describe_key(key)) + amount
    if number > INT64_MAX or number < INT64_MIN:
        number = wrap_int64(number)
    return number


def compare_set_refusal(current: Optional[bytes], expected: bytes, desired: bytes) -> Optional[bytes]:
    """compare_set's rule, the same in every store (torch's four cases): None when the
    store writes ``desired`` (and returns it), else what it returns without writing.

    * key absent, expected empty: write, return desired;
    * key absent, expected non-empty: no write, return **expected**;
    * key present and equal to expected (bytes equality): write, return desired;
    * key present and different: no write, return the current value.
    """
    if current is None:
        return expected if expected else None
    return None if current == expected else current


class Store(abc.ABC):
    """Base class of every store (torch.distributed.Store)."""

    def __init__(self, timeout: TimeoutLike = DEFAULT_STORE_TIMEOUT):
        self._timeout_s = as_seconds(timeout, "store timeout")

    # -- timeout -----------------------------------------------------------------------------

    @property
    def timeout(self) -> timedelta:
        """The default wait of get, wait, multi_get, blocking queue_pop and barrier."""
        return timedelta(seconds=self._timeout_s)

    def set_timeout(self, timeout: TimeoutLike) -> None:
        self._timeout_s = as_seconds(timeout, "store timeout")

    def _wait_seconds(self, timeout: Optional[TimeoutLike]) -> float:
        return self._timeout_s if timeout is None else as_seconds(timeout, "wait timeout")

    def describe(self) -> str:
        """Where this store lives, for error messages (``TCPStore 10.0.0.2:29500``)."""
        return type(self).__name__

    def wait_timeout_error(self, keys: Sequence[str], seconds: float, detail: str = "") -> DistStoreError:
        """The error for a wait that ran out: names the keys, the time and the store.

        The text starts as torch's does (``wait timeout after <ms>ms, keys: ...``) so that
        code matching torch's message keeps matching.
        """
        shown = ", ".join(keys) if keys else "(none)"
        text = (
            f"wait timeout after {int(seconds * 1000)}ms, keys: {shown} "
            f"(waited {format_duration(seconds)} on {self.describe()}"
        )
        text += f"; {detail})" if detail else ")"
        return DistStoreError(text)

    # -- the core every store implements -----------------------------------------------------

    @abc.abstractmethod
    def set(self, key: str, value: ValueLike) -> None:
        """Set ``key`` to ``value``, replacing any old value; wakes waiters on the key."""

    @abc.abstractmethod
    def get(self, key: str) -> bytes:
        """The value of ``key``, waiting up to the store timeout for it to be set."""

    @abc.abstractmethod
    def add(self, key: str, amount: int) -> int:
        """Add ``amount`` to the counter ``key`` (absent = 0) and return the new value."""

    @abc.abstractmethod
    def compare_set(self, key: str, expected_value: ValueLike, desired_value: ValueLike) -> bytes:
        """Set ``key`` to ``desired_value`` if it holds ``expected_value``; torch's four
        cases (``compare_set_refusal``)."""

    @abc.abstractmethod
    def check(self, keys: List[str]) -> bool:
        """True iff every key in ``keys`` exists (True for an empty list). Never blocks."""

    @abc.abstractmethod
    def wait(self, keys: List[str], timeout: Optional[TimeoutLike] = None) -> None:
        """Block until every key exists; DistStoreError after ``timeout`` (default: the store's)."""

    @abc.abstractmethod
    def delete_key(self, key: str) -> bool:
        """Remove ``key``; True if it existed, False if it did not (every distlib store;
        torch's FileStore says True always)."""

    @abc.abstractmethod
    def num_keys(self) -> int:
        """How many keys the store holds (internal keys included where torch counts them)."""

    # -- the extended API, with torch's generic fallbacks ------------------------------------

    def has_extended_api(self) -> bool:
        """True when append/multi_get/multi_set are native rather than generic loops."""
        return False

    def append(self, key: str, value: ValueLike) -> None:
        """Append to ``key``'s value, creating the key if absent.

        Generic form (torch's): a compare_set loop, so concurrent appends never lose data.
        """
        check_key(key)
        extra = to_bytes(value)
        current = self.compare_set(key, b"", extra)
        proposal = extra
        while current != proposal:
            proposal = current + extra
            current = self.compare_set(key, current, proposal)

    def multi_get(self, keys: List[str]) -> List[bytes]:
        """The values of ``keys`` in order, waiting for each (one shared deadline)."""
        keys = check_keys(keys)
        self.wait(keys)
        return [self.get(k) for k in keys]

    def multi_set(self, keys: List[str], values: List[ValueLike]) -> None:
        keys = check_keys(keys)
        values = list(values)
        if len(keys) != len(values):
            raise DistStoreError(
                f"multiSet keys and values vectors must be of same size "
                f"({len(keys)} keys, {len(values)} values)"
            )
        for k, v in zip(keys, values, strict=True):
            self.set(k, v)

    def queue_push(self, key: str, value: ValueLike) -> None:
        raise NotImplementedError("queue support is not implemented.")

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        raise NotImplementedError("queue support is not implemented.")

    def queue_len(self, key: str) -> int:
        raise NotImplementedError("queue support is not implemented.")

    def list_keys(self) -> List[str]:
        raise NotImplementedError(f"{type(self).__name__} does not support list_keys")

    def barrier(self, key: str, world_size: int, timeout: Optional[TimeoutLike] = None) -> None:
        """Block until ``world_size`` callers have reached the barrier named ``key``.

        torch's generic algorithm: ``n = add(key + "/num_members", 1)``; the caller whose add
        returns exactly ``world_size`` sets ``key + "/last_member"``; everyone waits for it.
        """
        check_key(key)
        seconds = self._wait_seconds(timeout)
        n = self.add(key + "/num_members", 1)
        if n == world_size:
            self.set(key + "/last_member", b"1")
        self.wait([key + "/last_member"], timedelta(seconds=seconds))

    def clone(self) -> "Store":
        """A new handle on the same store (TCPStore: a new connection)."""
        raise NotImplementedError(f"{type(self).__name__} cannot be cloned")

    # -- helpers for subclasses --------------------------------------------------------------

    def _deadline(self, timeout: Optional[TimeoutLike]) -> Deadline:
        return Deadline(self._wait_seconds(timeout))
