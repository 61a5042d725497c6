"""``FileStore(file_name, world_size=-1)``: torch's FileStore, byte for byte, in Python.

The store is a file every process opens: torch's append-only record log, which torch 2.13
processes and distlib processes can share (docs/stores-filestore.md). This module is the
Store API over it; the parts live beside it:

* ``file_log.py`` — the on-disk format (records, tombstones, refcount keys), no I/O;
* ``file_io.py`` — ``LogFile``: one FileStore's view of the file (cache, offset) and every
  operation's open/flock/read/append/unlock cycle;
* ``file_join.py`` — ``JoinedFile``: joining (the constructor) and closing (the destructor),
  with torch's refcount and cleanup rules, over a ``LogFile``'s public methods; the object
  this store talks to (it passes the operations on to its LogFile);
* ``file_locks.py`` — ``flock`` with a deadline, and the error for a file system that
  cannot lock;
* ``file_mounts.py`` — the mount-table check for NFS/Lustre mounts with host-local locks;
* ``file_sidecar.py`` — the liveness side file ``<file>.distlib-live`` that tells a crashed
  run's file from a live one.

Where distlib differs from torch, on purpose (docs/stores-filestore.md):

* timeouts are precise (torch rounds to whole seconds and fires up to a second late), a
  zero timeout means "do not wait" (torch: forever), and every timeout error names the keys
  and the file;
* ``delete_key`` says whether the key existed (torch: True always);
* a missing directory fails at once, naming it (torch retries ``open`` for the whole store
  timeout, 5 minutes by default);
* the file system is checked at open: an NFS mount whose locks are local to one host
  (``nolock``, ``local_lock=flock|all``) or a failing ``flock`` is a clear error, not a
  silent race;
* a file left by a crashed earlier distlib run is detected through the liveness side file
  instead of silently mixing runs;
* a damaged file (a record cut short by a writer that crashed mid-write, zeros, an empty
  key, a length field beyond ``file_log``'s limits) is an error naming the byte offset, never
  misread; a file truncated or rewritten under its users is named as such; only a regular
  file is joined, and reads are bounded, so no path is read without end;
* every OS error is a DistStoreError naming the file, the operation and the errno, with a
  hint (a read-only mount, a directory given as the path);
* get/wait poll with a backoff from 1 ms to torch's 10 ms (see ``POLL_FIRST_S``).
"""

from __future__ import annotations

import logging
import os
import time
import weakref
from typing import Iterator, List, Optional

from ..deadline import Deadline, TimeoutLike
from .base import DEFAULT_STORE_TIMEOUT, Store, ValueLike, check_key, check_keys, to_bytes
from .file_guard import guard
from .file_join import JoinedFile
from .file_mounts import check_mount
from .file_sidecar import SIDECAR_SUFFIX

log = logging.getLogger("distlib.store.file")

#: First poll interval of get/wait. A waiter usually waits for a peer a few milliseconds
#: behind it; starting at 1 ms cuts the mean wake-up latency of such short waits ~5× against
#: torch's fixed 10 ms, while each poll (open, flock, read, close: ~6 µs of work) stays cheap.
POLL_FIRST_S = 0.001
#: Largest poll interval: torch's 10 ms, so a long wait costs the file system (on NFS: a few
#: RPCs per poll) no more than torch does.
POLL_MAX_S = 0.010

#: The shortest time an operation waits for the file lock before it gives up. Locks are held
#: for microseconds; a lock held for this long means a stopped or hung process (or a stuck
#: NFS lock). The store timeout applies when it is longer; a zero store timeout ("do not
#: wait" for keys) does not make ordinary operations fail on a busy lock.
MIN_LOCK_WAIT_S = 30.0


def _finalize(log_: JoinedFile) -> None:
    """The destructor (garbage collection or interpreter exit): close, never raise."""
    try:
        log_.close()
    except Exception as exc:  # a destructor must not raise; say what went wrong instead
        log.warning("closing FileStore %s failed: %s", log_.path, exc)


class FileStore(Store):
    """``FileStore(file_name, world_size=-1)``: a store in a file shared by all processes.

    ``world_size`` (≥ 0) is how many users must have closed the file before the last one
    removes it; −1 keeps the file. Use ``close()`` or ``with FileStore(...) as store:``; an
    unclosed store is closed when garbage collected or at interpreter exit, as torch's
    destructor does.
    """

    def __init__(self, file_name: str, world_size: int = -1):
        super().__init__(DEFAULT_STORE_TIMEOUT)
        if isinstance(world_size, bool) or not isinstance(world_size, int):
            raise TypeError(f"world_size must be an int, got {type(world_size).__name__}")
        path = os.path.abspath(os.fsdecode(os.fspath(file_name)))
        mount = check_mount(path)
        # on NFS (or another network file system) each operation gets a deadline: file_guard.py
        self._log = guard(JoinedFile(path, world_size, max(self._timeout_s, MIN_LOCK_WAIT_S)), mount)
        self._log.join()
        self._finalizer = weakref.finalize(self, _finalize, self._log)

    # -- identity and lifetime -----------------------------------------------------------------

    @property
    def path(self) -> str:
        """Absolute path of the store file."""
        return self._log.path

    @property
    def world_size(self) -> int:
        return self._log.world_size

    @property
    def closed(self) -> bool:
        return self._log.closed

    def describe(self) -> str:
        return f"FileStore {self._log.path}"

    def __repr__(self) -> str:
        state = ", closed" if self._log.closed else ""
        return f"FileStore({self._log.path!r}, world_size={self._log.world_size}{state})"

    def close(self) -> None:
        """Leave the store as torch's destructor does (idempotent); may remove the file."""
        self._finalizer.detach()
        self._log.close()

    def __enter__(self) -> "FileStore":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def set_timeout(self, timeout: TimeoutLike) -> None:
        super().set_timeout(timeout)
        self._log.lock_wait_s = max(self._timeout_s, MIN_LOCK_WAIT_S)

    def clone(self) -> "FileStore":
        """A new FileStore on the same file (refcount + 1), with this store's timeout."""
        self._log.ensure_open()
        other = FileStore(self._log.path, self._log.world_size)
        other.set_timeout(self._timeout_s)
        return other

    # -- core ----------------------------------------------------------------------------------

    def set(self, key: str, value: ValueLike) -> None:
        self._log.set(_file_key(key), value if type(value) is bytes else to_bytes(value))

    def get(self, key: str) -> bytes:
        fkey = _file_key(key)
        value = self._log.lookup(fkey)
        if value is None:
            # The deadline starts after the first look (a few µs late, not worth a clock
            # read and an object on every hit).
            for _ in self._polls(Deadline(self._timeout_s), [key], [fkey]):
                value = self._log.lookup(fkey)
                if value is not None:
                    break
        return value

    def add(self, key: str, amount: int) -> int:
        return self._log.add(_file_key(key), int(amount), key)

    def compare_set(self, key: str, expected_value: ValueLike, desired_value: ValueLike) -> bytes:
        fkey = _file_key(key)
        expected = to_bytes(expected_value, "expected_value")
        desired = to_bytes(desired_value, "desired_value")
        return self._log.compare_set(fkey, expected, desired)

    def check(self, keys: List[str]) -> bool:
        if isinstance(keys, (str, bytes)):
            check_keys(keys)  # raises: a lone string is a slip, as in torch
        try:
            found = self._log.has_user_keys(keys)
        except AttributeError:
            check_keys(keys)  # a key that is not a str: say so
            raise
        if not found:  # the lookup stopped at the first missing key: the rest must be str too
            check_keys(keys)
        return found

    def wait(self, keys: List[str], timeout: Optional[TimeoutLike] = None) -> None:
        keys = check_keys(keys)
        fkeys = [b"/" + k.encode("utf-8") for k in keys]
        deadline = Deadline(self._wait_seconds(timeout))
        if self._log.has_all(fkeys):
            return
        for _ in self._polls(deadline, keys, fkeys):
            if self._log.has_all(fkeys):
                return

    def delete_key(self, key: str) -> bool:
        """Append a tombstone (as torch does, whether or not the key exists); True if the key
        existed, False if not (torch says True always, which tells a caller nothing)."""
        return self._log.delete(_file_key(key))

    def num_keys(self) -> int:
        """Live entries, ``refcount/`` and ``cleanup/`` included (torch counts them)."""
        return len(self._log.snapshot())

    def list_keys(self) -> List[str]:
        """Live keys with their first character removed (torch: ``refcount/`` → ``efcount/``).

        Newest key first, which is the order torch 2.13 was seen to return.
        """
        return [k[1:].decode("utf-8", "surrogateescape") for k in reversed(self._log.snapshot())]

    # -- torch's FileStore has no extended API and no queues ------------------------------------

    def has_extended_api(self) -> bool:
        return False

    # -- waiting -------------------------------------------------------------------------------

    def _polls(self, deadline: Deadline, keys: List[str], fkeys: List[bytes]) -> Iterator[int]:
        """Sleep between polls of get/wait; raise the timeout error once the deadline is past.

        The caller checks before the first sleep and after each one. Intervals grow 1 ms →
        10 ms (``POLL_FIRST_S``); the last sleep ends exactly at the deadline and is followed
        by one more check, so the wait is precise to a poll. Between polls the path is
        checked to still name the joined file, so a removed file is an error, not a timeout.
        """
        delay = POLL_FIRST_S
        polls = 0
        log_ = self._log
        while True:
            left = deadline.remaining()
            if left <= 0:
                cache = log_.cache
                missing = [k for k, f in zip(keys, fkeys, strict=True) if f not in cache]
                raise self.wait_timeout_error(
                    missing or keys,
                    deadline.seconds,
                    f"polled the file {polls} times; it holds {len(cache)} entries",
                )
            time.sleep(min(delay, left))
            delay = min(delay * 2, POLL_MAX_S)
            polls += 1
            yield polls
            log_.check_identity()


def _file_key(key: str) -> bytes:
    """``/`` + the key's UTF-8 bytes; keys must be str, as in torch."""
    try:
        return b"/" + key.encode("utf-8")
    except AttributeError:
        check_key(key)
        raise


__all__ = ["FileStore", "SIDECAR_SUFFIX", "POLL_FIRST_S", "POLL_MAX_S", "MIN_LOCK_WAIT_S"]
