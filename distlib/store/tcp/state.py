"""``KeyValueState``: what a TCPStore server holds and what each request does to it.

Kept apart from the event loop (server.py) so that the store's semantics have one home,
with no sockets, and can be tested on its own (tests/store/test_store_state.py): the keys
and values, the queues, who waits for what, counters (ADD and BARRIER written once), and
compare_set. The server decodes a request (codec.py), calls one method here and encodes
the reply; the batch path (batch.py) calls the same methods.

A party that waits is a ``Waiter`` (the server's connections are Waiters). When every key
a waiter waits for exists, or its barrier fills, the state clears the waiter's wait and
calls ``on_release(waiter)``, at once, so that the server queues the waiter's STOP_WAITING
before any later reply of the same loop turn.

Where torch's two servers disagree or misbehave, this state takes the behaviour torch's
documentation promises (a key exists once set, a wait returns when its keys exist) and
stays acceptable to torch clients:

* compare_set wakes waiters when it writes the key, and only then (libuv also wakes on a
  compare_set that changed nothing, so a torch ``get`` can return ``b""`` for a key that was
  never set; legacy never wakes, so a waiter can miss a key that compare_set created).
* A BARRIER increment that does not complete the barrier still wakes plain waiters on the
  barrier's key (the key now exists), not the barrier's own participants.
* A key "exists" for check and wait when it holds a value or a non-empty queue (libuv's
  rule); a queue push releases one waiter, a write every waiter of the key.

**What waits cost.** A wait makes the server hold state per key until the key appears: the
key, its entry in ``waiters`` and the waiter's list of keys. Without a bound, a client could
WAIT on 100,000 keys nobody sets from each of a few connections and grow the master by
hundreds of megabytes (issue 28). So ``wait_bytes`` counts ``len(key) + WAIT_KEY_COST`` bytes
for each key a wait registers, and ``WAITED_KEY_COST`` more for each key waited for at all
(the server counts it against its one memory budget; ``cost_of(waiter)`` is one waiter's
share, for eviction). A key's registrations are given back together when the key appears (one
subtraction for a barrier's thousands of waiters), a waiter's when it is cancelled. A WAIT
may name at most ``max_wait_keys`` keys (per
connection: a connection has one wait at a time; the server refuses a larger one as soon as
its count arrives), and the state waits for at most ``max_waiting_keys`` distinct keys in all;
past either cap the WAIT is refused with a StateError (the server closes that connection and
says why).
"""

from __future__ import annotations

import collections
from itertools import accumulate
from typing import Callable, Deque, Dict, List, Optional, Sequence, Tuple

from ..base import INT64_MAX, INT64_MIN, add_to_counter, compare_set_refusal, describe_key, wrap_int64
from .codec import MAX_VALUE_BYTES
from .sessions import Sessions

#: Bytes each key a wait registers costs beyond the key's own: its bytes object's header and
#: its slots in ``waiters[key]`` and in the waiter's key list ...
WAIT_KEY_COST = 56
#: ... and a key nobody waited for yet, its entry in ``waiters`` and its list (charged to the
#: wait that adds it). tests/store/test_store_state.py checks both against tracemalloc.
WAITED_KEY_COST = 128
#: Keys one WAIT may leave missing (torch's default server takes 131072 keys per request; a
#: job that waits for one key per rank waits for tens of thousands at most).
MAX_WAIT_KEYS = 65536
#: Distinct keys the state waits for, over every client.
MAX_WAITING_KEYS = 1 << 20


class StateError(ValueError):
    """A request the state refuses: ADD on a value that is not a number, an APPEND past
    the value limit. The server closes that client's connection with this text (the
    protocol has no error reply, and torch's servers do the same)."""


class Waiter:
    """A party that can wait for keys or a barrier: ``wait_count`` > 0 while it waits."""

    __slots__ = ("wait_count", "wait_keys", "barrier_key", "closed")

    def __init__(self) -> None:
        self.wait_count = 0  # keys (or 1 for a barrier) still missing
        self.wait_keys: Sequence[bytes] = ()
        self.barrier_key: Optional[bytes] = None
        self.closed = False  # a closed waiter is never released


class KeyValueState:
    """The store's contents and waits. ``data`` may be read directly (the server's GET and
    LIST_KEYS do); every change goes through a method, which wakes the waiters it should."""

    def __init__(self, on_release: Callable[[Waiter], None], max_value: int = MAX_VALUE_BYTES,
                 max_wait_keys: int = MAX_WAIT_KEYS, max_waiting_keys: int = MAX_WAITING_KEYS):
        self.on_release = on_release
        self.max_value = max_value
        self.max_wait_keys = max_wait_keys
        self.max_waiting_keys = max_waiting_keys
        self.data: Dict[bytes, bytes] = {}
        self.queues: Dict[bytes, Deque[bytes]] = {}
        self.waiters: Dict[bytes, List[Waiter]] = {}
        self.barrier_waiters: Dict[bytes, List[Waiter]] = {}
        #: What every pending wait holds, in bytes (see "What waits cost" above).
        self.wait_bytes = 0
        #: The clients' sessions: their last sequenced write and its reply (sessions.py).
        self.sessions = Sessions()

    def begin_group(self) -> None:
        """A sequenced write begins: its changes and its session's entry belong together (the
        journaled state records them as one; here, nothing to do)."""

    def end_group(self, more: Optional[List[bytes]]) -> None:
        """The sequenced write ended; ``more``: its session's records (None: it failed)."""

    # -- reading -----------------------------------------------------------------------------------

    def present(self, key: bytes) -> bool:
        """Whether ``key`` holds a value or a non-empty queue."""
        return key in self.data or bool(self.queues.get(key))

    def check(self, keys: Sequence[bytes]) -> bool:
        """CHECK: whether every key is present (no key: True)."""
        present = self.present
        return all(present(k) for k in keys)

    def num_keys(self) -> int:
        """GETNUMKEYS: the keys with a value (queues are not counted)."""
        return len(self.data)

    # -- writing -----------------------------------------------------------------------------------

    def set(self, key: bytes, value: bytes) -> None:
        self.data[key] = value
        if key in self.waiters:
            self._wake(key)

    def multi_set(self, pairs: Sequence[Tuple[bytes, bytes]]) -> None:
        data = self.data
        waiters = self.waiters
        for key, value in pairs:
            data[key] = value
            if key in waiters:
                self._wake(key)

    def append(self, key: bytes, value: bytes) -> None:
        """APPEND: create or extend; StateError past ``max_value`` (nothing changes then)."""
        old = self.data.get(key)
        new = value if old is None else old + value
        if len(new) > self.max_value:
            raise StateError(
                f"APPEND to key {describe_key(key)} would make a value of {len(new)} bytes, "
                f"over the limit of {self.max_value}")
        KeyValueState.set(self, key, new)  # (not an override's: a journal records the APPEND itself)

    def delete(self, key: bytes) -> bool:
        """DELETE_KEY: whether the key was there. Waiters are neither woken nor cancelled."""
        return self.data.pop(key, None) is not None

    def compare_set(self, key: bytes, expected: bytes, desired: bytes) -> bytes:
        """torch's four cases (``base.compare_set_refusal``); wakes waiters only when it
        writes."""
        refused = compare_set_refusal(self.data.get(key), expected, desired)
        if refused is not None:
            return refused
        self.data[key] = desired
        if key in self.waiters:
            self._wake(key)
        return desired

    # -- counters ----------------------------------------------------------------------------------

    def counter(self, key: bytes, what: str = "ADD") -> int:
        """The number at ``key`` as ADD reads it (absent: 0). StateError, naming ``what``
        and the key, when it holds no number."""
        try:
            return add_to_counter(self.data.get(key), 0, key)
        except (ValueError, IndexError) as exc:
            raise _not_a_counter(what, key, exc) from None

    def add(self, key: bytes, delta: int, what: str = "ADD") -> int:
        """ADD (``base.add_to_counter``), stored as decimal ASCII; wakes waiters; the new
        value. StateError, naming ``what`` and the key, when the key holds no number."""
        old = self.data.get(key)
        if old is not None and old.isdigit() and len(old) < 19:  # add_to_counter's usual case,
            value = int(old) + delta  # inline: the request path of every single-client ADD
            if value > INT64_MAX:
                value = wrap_int64(value)
        else:
            try:
                value = add_to_counter(old, delta, key)
            except (ValueError, IndexError) as exc:
                raise _not_a_counter(what, key, exc) from None
        self.data[key] = b"%d" % value
        if key in self.waiters:
            self._wake(key)
        return value

    def add_many(self, key: bytes, deltas: Sequence[int]) -> List[int]:
        """Several ADDs on one key in a row: the value after each, as ``add`` would return
        them, with one parse, one store and one wake-up (a barrier's arrivals in one turn)."""
        values = list(accumulate(deltas, initial=self.counter(key)))  # C-level: once per rank
        del values[0]
        if values and (max(values) > INT64_MAX or min(values) < INT64_MIN):
            values = []  # a run that wraps: add_to_counter's rule, one ADD at a time
            value = self.counter(key)
            for delta in deltas:
                value = wrap_int64(value + delta)
                values.append(value)
        if not values:
            return values
        self.data[key] = b"%d" % values[-1]
        if key in self.waiters:
            self._wake(key)
        return values

    # -- queues ------------------------------------------------------------------------------------

    def queue_push(self, key: bytes, value: bytes) -> None:
        """QUEUE_PUSH: append; release the first waiter this push satisfies (torch's rule)."""
        self.queues.setdefault(key, collections.deque()).append(value)
        if key in self.waiters:
            self._wake_one(key)

    def queue_pop(self, key: bytes) -> Tuple[int, Optional[bytes]]:
        """QUEUE_POP: (length before the pop, the front value), or (0, None) when empty."""
        queue = self.queues.get(key)
        if not queue:
            return 0, None
        length = len(queue)
        value = queue.popleft()
        if not queue:
            del self.queues[key]
        return length, value

    def queue_len(self, key: bytes) -> int:
        return len(self.queues.get(key, ()))

    # -- waiting -----------------------------------------------------------------------------------

    def wait(self, waiter: Waiter, keys: Sequence[bytes]) -> bool:
        """WAIT: True when every key is present now; else ``waiter`` waits for the missing
        ones (a key listed twice counts twice, as torch) and False."""
        data = self.data
        queues = self.queues
        waiters = self.waiters
        if len(keys) == 1:  # the usual case (every rank of a barrier), without a loop
            key = keys[0]
            if key in data or queues.get(key):
                return True
            waiting = waiters.get(key)
            if waiting is None:
                if len(waiters) >= self.max_waiting_keys:
                    raise self._too_many_waiting(1)
                waiters[key] = [waiter]
                self.wait_bytes += len(key) + (WAIT_KEY_COST + WAITED_KEY_COST)
            else:
                waiting.append(waiter)
                self.wait_bytes += len(key) + WAIT_KEY_COST
            waiter.wait_keys = keys
            waiter.wait_count = 1
            return False
        if len(keys) > self.max_wait_keys:
            raise self.too_many_keys(len(keys))
        missing = [k for k in keys if k not in data and not queues.get(k)]
        if not missing:
            return True
        if len(waiters) + len(missing) > self.max_waiting_keys:  # (exact only when all are new)
            new = sum([k not in waiters for k in missing])
            if len(waiters) + new > self.max_waiting_keys:
                raise self._too_many_waiting(new)
        new = 0
        for key in missing:
            waiting = waiters.get(key)
            if waiting is None:
                waiters[key] = [waiter]
                new += 1
            else:
                waiting.append(waiter)
        waiter.wait_keys = missing
        waiter.wait_count = len(missing)
        self.wait_bytes += sum(map(len, missing)) + WAIT_KEY_COST * len(missing) + WAITED_KEY_COST * new
        return False

    def cost_of(self, waiter: Waiter) -> int:
        """About what ``waiter``'s pending wait holds, in bytes (the keys it still misses, at
        the mean length of those it asked for): which connection to evict first."""
        count = waiter.wait_count
        if not count:
            return 0
        keys = waiter.wait_keys or (waiter.barrier_key or b"",)
        return count * (sum(map(len, keys)) // len(keys) + WAIT_KEY_COST)

    def wait_all(self, waiters: Sequence[Waiter], key: bytes) -> bool:
        """``wait(w, [key])`` for each of ``waiters`` at once (a barrier's ranks, one turn's
        WAITs on its key; batch.py): True when the key is present now (none of them waits),
        else they all wait for it. The caller checks ``may_wait_for(key)`` first."""
        if key in self.data or self.queues.get(key):
            return True
        waiting = self.waiters.get(key)
        if waiting is None:
            waiting = self.waiters[key] = []
            self.wait_bytes += WAITED_KEY_COST
        waiting += waiters
        self.wait_bytes += len(waiters) * (len(key) + WAIT_KEY_COST)
        keys = (key,)
        for waiter in waiters:
            waiter.wait_keys = keys
            waiter.wait_count = 1
        return False

    def may_wait_for(self, key: bytes) -> bool:
        """Whether a new wait on ``key`` stays within ``max_waiting_keys``."""
        return key in self.waiters or len(self.waiters) < self.max_waiting_keys

    def too_many_keys(self, count: int) -> StateError:
        """The refusal of a WAIT that names more than ``max_wait_keys`` keys."""
        return StateError(f"WAIT on {count} keys: one client may wait for at most {self.max_wait_keys} keys at once "
                          f"(--max-wait-keys-per-client)")

    def _too_many_waiting(self, more: int) -> StateError:
        return StateError(
            f"WAIT on {more} more missing key{'s' if more != 1 else ''}: the server already waits for "
            f"{len(self.waiters)} distinct keys for its clients, and waits for at most {self.max_waiting_keys} "
            f"(--max-wait-keys)")

    def barrier(self, waiter: Waiter, key: bytes, world_size: int) -> bool:
        """BARRIER: counter ``key`` += 1 (ADD's rules). True when that fills the barrier (its
        earlier participants are released); else ``waiter`` waits for the rest and False."""
        count = self.add(key, 1, "BARRIER")
        if count >= world_size:
            released = self.barrier_waiters.pop(key, None)
            if released:
                self.wait_bytes -= len(released) * (len(key) + WAIT_KEY_COST) + WAITED_KEY_COST
                for other in released:
                    if not other.closed and other.wait_count:
                        other.wait_count = 0
                        self._release(other)
            return True
        if key not in self.barrier_waiters and len(self.barrier_waiters) >= self.max_waiting_keys:
            raise StateError(f"BARRIER on a new key: the server already holds {len(self.barrier_waiters)} barriers "
                             f"for its clients, and at most {self.max_waiting_keys} (--max-wait-keys)")
        waiting = self.barrier_waiters.get(key)
        if waiting is None:
            self.barrier_waiters[key] = [waiter]
            self.wait_bytes += len(key) + (WAIT_KEY_COST + WAITED_KEY_COST)
        else:
            waiting.append(waiter)
            self.wait_bytes += len(key) + WAIT_KEY_COST
        waiter.barrier_key = key
        waiter.wait_count = 1
        return False

    def cancel(self, waiter: Waiter) -> None:
        """Forget every wait of ``waiter`` (CANCEL_WAIT, or its connection closed)."""
        freed = 0
        for key in waiter.wait_keys:
            freed += _unregister(self.waiters, key, waiter)
        if waiter.barrier_key is not None:
            freed += _unregister(self.barrier_waiters, waiter.barrier_key, waiter)
        self.wait_bytes -= freed
        waiter.wait_keys = ()
        waiter.barrier_key = None
        waiter.wait_count = 0

    def _wake(self, key: bytes) -> None:
        """``key`` now exists: count it off every wait on it; release the complete ones
        (``_release``, inline: a barrier's release runs this loop once per rank)."""
        waiting = self.waiters.pop(key, None)
        if not waiting:
            return
        self.wait_bytes -= len(waiting) * (len(key) + WAIT_KEY_COST) + WAITED_KEY_COST
        on_release = self.on_release
        for waiter in waiting:
            if waiter.closed or not waiter.wait_count:
                continue
            waiter.wait_count -= 1
            if waiter.wait_count == 0:
                waiter.wait_keys = ()
                waiter.barrier_key = None
                on_release(waiter)

    def _wake_one(self, key: bytes) -> None:
        """A queue push: count it off waits on ``key`` in order until one completes."""
        waiting = self.waiters.get(key)
        while waiting:
            waiter = waiting.pop(0)
            self.wait_bytes -= len(key) + WAIT_KEY_COST
            if waiter.closed or not waiter.wait_count:
                continue
            waiter.wait_count -= 1
            if waiter.wait_count == 0:
                self._release(waiter)
                break
        if not waiting and self.waiters.pop(key, None) is not None:
            self.wait_bytes -= WAITED_KEY_COST

    def _release(self, waiter: Waiter) -> None:
        waiter.wait_keys = ()
        waiter.barrier_key = None
        self.on_release(waiter)


def _not_a_counter(what: str, key: bytes, exc: Exception) -> StateError:
    return StateError(f"{what} on key {describe_key(key)}: {exc}")


def _unregister(registry: Dict[bytes, List[Waiter]], key: bytes, waiter: Waiter) -> int:
    """Take ``waiter`` off ``registry[key]`` (once), and the key off when none is left; the
    bytes that frees (``wait_bytes``' share of it)."""
    waiting = registry.get(key)
    if waiting is None:
        return 0
    try:
        waiting.remove(waiter)
    except ValueError:
        return 0
    if waiting:
        return len(key) + WAIT_KEY_COST
    del registry[key]
    return len(key) + WAIT_KEY_COST + WAITED_KEY_COST
