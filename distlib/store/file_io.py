"""``LogFile``: the store file as one FileStore sees it, and every operation's I/O cycle.

The store file is torch's append-only record log (the bytes: ``file_log.py``). Each
operation opens the file, takes a whole-file ``flock`` (``LOCK_EX`` to write, ``LOCK_SH`` to
read; ``file_locks.py``), reads the records it has not seen yet from its cached offset up to
EOF, appends at most one record per change, unlocks and closes (docs/wire-protocol.md,
"FileStore"). Reads never trust ``st_size`` or ``mtime`` (NFS caches them): they read until
``read()`` returns nothing, under the lock.

Reference counting is torch's: ``join`` (the constructor) adds 1 to ``refcount/``; ``close``
(or the destructor, or interpreter exit) adds 1 to ``cleanup/`` and -1 to ``refcount/``, and
unlinks the file when the refcount reaches 0, ``world_size >= 0`` and
``cleanup >= world_size``. Joining and closing also register in the liveness side file
(``file_sidecar.py``), so a file left by a crashed run is an error, not a silent mix.

Damage is named, never misread: under the lock no writer is mid-record, so bytes that do not
form a whole record are reported with their byte offset; a file truncated, replaced or
removed while in use is an error that says so.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Dict, List, Optional, Tuple

from ..deadline import Deadline, format_duration
from ..errors import DistStoreError
from . import file_log
from .base import add_to_counter, compare_set_refusal
from .file_locks import LOCK_EX, LOCK_SH, lock, unlink, unlock_close
from .file_sidecar import Liveness

log = logging.getLogger("distlib.store.file")

_READ_CHUNK = 65536
_RD_FLAGS = os.O_RDONLY | os.O_CLOEXEC
_WR_FLAGS = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC
_RW_FLAGS = os.O_RDWR | os.O_CLOEXEC
_FILE_MODE = 0o644

_u32 = file_log._pack_u32
_replay = file_log.replay
_REFCOUNT = file_log.REFCOUNT_KEY
_CLEANUP = file_log.CLEANUP_KEY


class _Shared:
    """One per file per process: a mutex and how many live FileStores here use the file.

    The mutex serialises operations of this process's FileStore objects on the file (threads,
    clones), so correctness inside one process never depends on how a file system implements
    flock() between open files of the same process (NFS emulates it with POSIX locks).
    ``live`` lets a new FileStore skip the stale-file check when this process already uses
    the file (it is live by definition).
    """

    __slots__ = ("mutex", "live")

    def __init__(self) -> None:
        self.mutex = threading.Lock()
        self.live = 0


_SHARED: Dict[str, _Shared] = {}
_SHARED_GUARD = threading.Lock()


def _shared_for(real_path: str) -> _Shared:
    with _SHARED_GUARD:
        shared = _SHARED.get(real_path)
        if shared is None:
            shared = _SHARED[real_path] = _Shared()
        return shared


def _after_fork_in_child() -> None:
    """A forked child gets fresh mutexes (a parent thread may have held one) and no live
    stores of its own: the copies it inherited are its parent's users, not its own."""
    global _SHARED_GUARD
    _SHARED_GUARD = threading.Lock()
    for shared in _SHARED.values():
        shared.mutex = threading.Lock()
        shared.live = 0


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


# ------------------------------------------------------------------------------------------
# The log: one FileStore's view of the file (cache, offset, liveness lock) and its I/O
# ------------------------------------------------------------------------------------------


class LogFile:
    """Everything a FileStore needs to operate and to close.

    Kept apart from the FileStore object so that ``weakref.finalize`` can close it when the
    FileStore is garbage collected (a finalizer must not hold the object it finalizes).
    """

    __slots__ = (
        "path",
        "world_size",
        "cache",
        "offset",
        "shared",
        "liveness",
        "identity",
        "pid",
        "closed",
        "chunk",
        "lock_wait_s",
    )

    def __init__(self, path: str, world_size: int, lock_wait_s: float) -> None:
        real = os.path.realpath(path)  # one side file and one mutex per file, however named
        self.path = path
        self.world_size = world_size
        self.cache: Dict[bytes, bytes] = {}
        self.offset = 0
        self.shared = _shared_for(real)
        self.liveness = Liveness(path, real, self.shared)
        self.identity: Tuple[int, int] = (0, 0)
        self.pid = os.getpid()
        self.closed = False
        self.chunk = _READ_CHUNK
        self.lock_wait_s = lock_wait_s

    # -- opening and locking -------------------------------------------------------------------

    def _open(self, flags: int) -> int:
        try:
            return os.open(self.path, flags, _FILE_MODE)
        except FileNotFoundError:
            raise self._vanished_error() from None

    def _vanished_error(self) -> DistStoreError:
        directory = os.path.dirname(self.path)
        if not os.path.isdir(directory):
            missing = _first_missing_dir(directory)
            also = f" ({missing} is missing)" if missing != directory else ""
            return DistStoreError(
                f"FileStore: directory {directory} of store file {self.path} does not exist"
                f"{also}; create it first (unlike torch, distlib does not wait for it to appear)"
            )
        return DistStoreError(
            f"FileStore: store file {self.path} no longer exists: it was removed while this "
            f"FileStore was using it (by hand, or by a user that closed it and found the "
            f"refcount at 0 — refcounts of a stale file from an earlier run?)"
        )

    # -- reading ---------------------------------------------------------------------------------

    def _begin(self, flags: int, op: int) -> int:
        """Start an operation: open, flock(op), read the new records. Returns the fd.

        The caller holds the process mutex and must call ``unlock_close(fd)``. This is the hot path
        of every operation, hence one method doing the three steps (each a few syscalls).
        """
        try:
            fd = os.open(self.path, flags, _FILE_MODE)
        except FileNotFoundError:
            raise self._vanished_error() from None
        try:
            lock(fd, op, self.path, self.lock_wait_s)
            data = os.pread(fd, self.chunk, self.offset)
            if data:
                self._absorb(fd, data)
        except BaseException:
            unlock_close(fd)
            raise
        return fd

    def _catch_up(self, fd: int) -> None:
        """Apply the records after ``offset`` (caller holds the lock)."""
        data = os.pread(fd, self.chunk, self.offset)
        if data:
            self._absorb(fd, data)

    def _absorb(self, fd: int, data: bytes) -> None:
        """Read on from ``data`` (the first bytes after ``offset``) to EOF and apply it all.

        EOF is where read() returns nothing, never ``st_size``. Under the lock no writer is
        mid-record, so bytes that do not form a whole record are damage, reported with the
        byte offset.
        """
        offset = self.offset
        got = len(data)
        pieces = None
        while True:  # ends at EOF: the file cannot grow while we hold the lock
            more = os.pread(fd, max(self.chunk, got), offset + got)
            if not more:
                break
            if pieces is None:
                pieces = [data]
            pieces.append(more)
            got += len(more)
        if pieces is not None:
            data = b"".join(pieces)
        done = _replay(data, self.cache)
        if done != got:
            self.offset = offset + done
            raise self._damage_error(data, done, offset)
        self.offset = offset + got

    def _damage_error(self, data: bytes, done: int, base: int) -> DistStoreError:
        return DistStoreError(
            f"FileStore: store file {self.path} is damaged at byte {base + done}: "
            f"{file_log.describe_damage(data, done)}. Writers append whole records under an "
            f"exclusive lock, so a process probably died in the middle of a write (or "
            f"something other than a FileStore wrote to the file). Remove {self.path} and "
            f"{self.liveness.path} and start the job again."
        )

    def _append(self, fd: int, record: bytes) -> None:
        """Append one record at the end we read to (caller holds LOCK_EX and caught up).

        The end is also checked with lseek: a file shorter than what we already read was
        truncated or replaced behind our back, and appending would corrupt it.
        """
        end = os.lseek(fd, 0, os.SEEK_END)
        if end != self.offset:
            raise self._moved_error(end)
        try:
            written = os.write(fd, record)
            while written < len(record):
                written += os.write(fd, record[written:])
        except OSError as exc:
            self._roll_back(fd, end)
            raise DistStoreError(f"FileStore: writing to store file {self.path} failed: {exc}") from exc
        self.offset = end + written

    def _roll_back(self, fd: int, end: int) -> None:
        """Cut a half-written record off (still under our lock), so the log stays whole."""
        try:
            os.ftruncate(fd, end)
        except OSError as exc:  # pragma: no cover - a disk error on top of a disk error
            log.error("could not roll back a partial record in %s at byte %d: %s", self.path, end, exc)

    def _moved_error(self, end: int) -> DistStoreError:
        if end < self.offset:
            why = "the file was truncated, or removed and created again, while in use"
        else:
            why = (
                "reading stopped short of the end: something writes to it without the lock, "
                "or the file system does not keep locked files coherent"
            )
        return DistStoreError(
            f"FileStore: store file {self.path} ends at byte {end} but this FileStore has "
            f"read {self.offset} bytes of it: {why}. Nothing was written."
        )

    def check_identity(self) -> None:
        """Raise when the path no longer names the file we joined (removed or replaced).

        Called between polls of get/wait (a poll sleeps ≥ 1 ms, so the stat is free there),
        so a waiter on a file that went away fails with the reason instead of timing out.
        """
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            raise self._vanished_error() from None
        if (st.st_dev, st.st_ino) != self.identity:
            raise DistStoreError(
                f"FileStore: store file {self.path} was replaced by another file while this "
                f"FileStore was using it (removed and created again)."
            )

    # -- operations (each: one open/lock/read/[write]/unlock/close cycle) ------------------------

    def _ensure_open(self) -> None:
        if self.closed:
            raise DistStoreError(f"FileStore {self.path} is closed")

    def _refresh_locked(self) -> None:
        """Bring the cache up to date under LOCK_SH (caller holds the process mutex)."""
        unlock_close(self._begin(_RD_FLAGS, LOCK_SH))

    def lookup(self, fkey: bytes) -> Optional[bytes]:
        """The current value of ``fkey`` (None when absent), read and looked up atomically."""
        if self.closed:
            self._ensure_open()
        with self.shared.mutex:
            self._refresh_locked()
            return self.cache.get(fkey)

    def has_all(self, fkeys: List[bytes]) -> bool:
        if self.closed:
            self._ensure_open()
        with self.shared.mutex:
            self._refresh_locked()
            cache = self.cache
            for fkey in fkeys:
                if fkey not in cache:
                    return False
            return True

    def has_user_keys(self, keys: List[str]) -> bool:
        """``has_all`` for user keys, encoding them only as far as needed (check's hot path)."""
        if self.closed:
            self._ensure_open()
        with self.shared.mutex:
            self._refresh_locked()
            cache = self.cache
            for key in keys:
                if b"/" + key.encode("utf-8") not in cache:
                    return False
            return True

    def snapshot(self) -> List[bytes]:
        """The live file keys, oldest first (a copy, safe against other threads)."""
        if self.closed:
            self._ensure_open()
        with self.shared.mutex:
            self._refresh_locked()
            return list(self.cache)

    def set(self, fkey: bytes, value: bytes) -> None:
        if self.closed:
            self._ensure_open()
        record = _u32(len(fkey)) + fkey + _u32(len(value)) + value
        with self.shared.mutex:
            fd = self._begin(_WR_FLAGS, LOCK_EX)
            try:
                self._append(fd, record)
                self.cache[fkey] = value
            finally:
                unlock_close(fd)

    def add(self, fkey: bytes, amount: int, key_name: str) -> int:
        if self.closed:
            self._ensure_open()
        with self.shared.mutex:
            fd = self._begin(_WR_FLAGS, LOCK_EX)
            try:
                return self._add_locked(fd, fkey, amount, key_name)
            finally:
                unlock_close(fd)

    def _add_locked(self, fd: int, fkey: bytes, amount: int, key_name: str) -> int:
        number = add_to_counter(self.cache.get(fkey), amount, key_name)
        value = b"%d" % number
        self._append(fd, _u32(len(fkey)) + fkey + _u32(len(value)) + value)
        self.cache[fkey] = value
        return number

    def compare_set(self, fkey: bytes, expected: bytes, desired: bytes) -> bytes:
        if self.closed:
            self._ensure_open()
        with self.shared.mutex:
            fd = self._begin(_WR_FLAGS, LOCK_EX)
            try:
                refused = compare_set_refusal(self.cache.get(fkey), expected, desired)
                if refused is not None:
                    return refused
                self._append(fd, _u32(len(fkey)) + fkey + _u32(len(desired)) + desired)
                self.cache[fkey] = desired
                return desired
            finally:
                unlock_close(fd)

    def delete(self, fkey: bytes) -> bool:
        """Append a tombstone (always, as torch: the file's bytes stay torch's); whether the
        key was there."""
        if self.closed:
            self._ensure_open()
        tomb = b"-" + fkey
        with self.shared.mutex:
            fd = self._begin(_RW_FLAGS, LOCK_EX)  # torch: O_RDWR without O_CREAT
            try:
                self._append(fd, _u32(len(tomb)) + tomb + b"\0\0\0\0")
                return self.cache.pop(fkey, None) is not None
            finally:
                unlock_close(fd)

    # -- joining: constructor --------------------------------------------------------------------

    def join(self) -> None:
        """The constructor's work: create/open the file, check it, refcount += 1.

        All under the file's LOCK_EX, so joiners and closers of every process (torch's too)
        are serialised: the stale check and the refcount see a settled file.
        """
        with self.shared.mutex:
            fd = self._open_locked_for_join()
            try:
                self._catch_up(fd)
                stale = (lambda users: self._stale_error(fd, users)) if self.offset > 0 else None
                self.liveness.join(stale, self.lock_wait_s)
                try:
                    self._add_locked(fd, _REFCOUNT, 1, "refcount/")
                except BaseException:
                    self.liveness.count_out(False)
                    self.liveness.release()
                    raise
            finally:
                unlock_close(fd)
        log.debug("joined %s (refcount now %s)", self.path, self.cache.get(_REFCOUNT))

    def _open_locked_for_join(self) -> int:
        """Open (creating) and LOCK_EX the file the path names *after* the lock is granted.

        A closing user may unlink the file while we wait for its lock; then the inode we
        locked is gone from the directory and we must open the path again (torch does not
        check, and can end up alone on an unlinked file).
        """
        deadline = Deadline(self.lock_wait_s)
        while True:
            fd = self._open(_WR_FLAGS)
            try:
                lock(fd, LOCK_EX, self.path, self.lock_wait_s)
                st = os.fstat(fd)
                try:
                    now = os.stat(self.path)
                except FileNotFoundError:
                    now = None
            except BaseException:
                unlock_close(fd)
                raise
            if now is not None and (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):
                self.identity = (st.st_dev, st.st_ino)
                return fd
            unlock_close(fd)
            if deadline.expired():
                raise DistStoreError(
                    f"FileStore: store file {self.path} kept being removed and created again "
                    f"for {format_duration(deadline.seconds)} while opening it"
                )
            log.debug("%s was unlinked while we waited for its lock; opening it again", self.path)

    def _stale_error(self, fd: int, dead_users: int) -> DistStoreError:
        """The store file ``fd`` (locked, read to its end) holds a dead run's records:
        ``Liveness.join`` found its distlib users gone without closing."""
        image = os.pread(fd, self.offset, 0)
        records = sum(1 for _ in file_log.iter_records(image))
        refcount = self.cache.get(_REFCOUNT, b"0").decode("ascii", "replace")
        cleanup = self.cache.get(_CLEANUP, b"0").decode("ascii", "replace")
        return DistStoreError(
            f"FileStore: store file {self.path} holds {records} records from an earlier run "
            f"whose processes are gone (refcount {refcount}, cleanup {cleanup}; {dead_users} distlib "
            f"user(s) never closed it: killed or crashed). Joining it would mix that run's keys "
            f"into this one. Remove {self.path} and {self.liveness.path} and start again."
        )

    # -- closing: destructor -------------------------------------------------------------------

    def close(self) -> None:
        """torch's destructor: cleanup/ += 1, refcount/ -= 1, maybe unlink; then let go.

        Both records are appended in one locked cycle (torch takes two; the bytes are the
        same). The side file's user count is lowered, and the liveness lock released, while
        the store file's LOCK_EX is still held, so a joiner never sees a dead-looking user.
        """
        if self.closed:
            return
        self.closed = True
        if os.getpid() != self.pid:
            # A forked copy: the parent owns this user (and the shared liveness lock).
            self.liveness.forget_in_fork()
            return
        with self.shared.mutex:
            try:
                if os.path.exists(self.path):  # torch: a file already gone means nothing to do
                    self._close_locked()
            finally:
                self.liveness.release()

    def _close_locked(self) -> None:
        try:
            fd = os.open(self.path, _RW_FLAGS)
        except FileNotFoundError:
            return
        try:
            lock(fd, LOCK_EX, self.path, self.lock_wait_s)
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != self.identity:
                log.warning(
                    "%s is no longer the file this FileStore joined (removed and created "
                    "again): not counting this close in it", self.path,
                )
                return
            self._catch_up(fd)
            finished = self._add_locked(fd, _CLEANUP, 1, "cleanup/")
            refcount = self._add_locked(fd, _REFCOUNT, -1, "refcount/")
            remove = refcount == 0 and self.world_size >= 0 and finished >= self.world_size
            self.liveness.count_out(remove)  # the side file goes first (Liveness.count_out)
            if remove:
                unlink(self.path)
                log.debug("last user closed %s (world size %d): removed", self.path, self.world_size)
            else:
                log.debug("closed %s (refcount %d, cleanup %d)", self.path, refcount, finished)
            self.liveness.release()
        finally:
            unlock_close(fd)


def _first_missing_dir(directory: str) -> str:
    """The outermost missing directory on the way to ``directory`` (for error texts)."""
    missing = directory
    parent = os.path.dirname(missing)
    while parent != missing and not os.path.isdir(parent):
        missing, parent = parent, os.path.dirname(parent)
    return missing
