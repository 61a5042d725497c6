"""``FileStore(file_name, world_size=-1)``: torch's FileStore, byte for byte, in Python.

The store is a file every process opens: an append-only log of records (format in
``file_log.py``) that torch 2.13 processes and distlib processes can share. Each operation
opens the file, takes a whole-file ``flock`` (``LOCK_EX`` to write, ``LOCK_SH`` to read),
reads the records it has not seen yet from its cached offset up to EOF, appends at most one
record per change, unlocks and closes (../shared/spec/c10d-store-protocol.md §3.2). Reads
never trust ``st_size`` or ``mtime`` (NFS caches them): they read until ``read()`` returns
nothing, under the lock.

Reference counting is torch's (§3.3): the constructor adds 1 to ``refcount/``; ``close()``
(or the destructor, or interpreter exit) adds 1 to ``cleanup/`` and −1 to ``refcount/``, and
unlinks the file when the refcount reaches 0, ``world_size >= 0`` and
``cleanup >= world_size``.

Where distlib differs from torch, on purpose (docs/stores-filestore.md):

* timeouts are precise (torch rounds to whole seconds and fires up to a second late), a
  zero timeout means "do not wait" (torch: forever), and every timeout error names the keys
  and the file;
* a missing directory fails at once, naming it (torch retries ``open`` for the whole store
  timeout, 5 minutes by default);
* the file system is checked at open: an NFS mount whose locks are local to one host
  (``nolock``, ``local_lock=flock|all``) or a failing ``flock`` is a clear error, not a
  silent race;
* a file left by a crashed earlier distlib run is detected through a liveness side file
  ``<file>.distlib-live`` (see ``_Log._join_sidecar``) instead of silently mixing runs;
* a damaged file (a record cut short by a writer that crashed mid-write) is an error naming
  the byte offset, never misread;
* get/wait poll with a backoff from 1 ms to torch's 10 ms (see ``POLL_FIRST_S``).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import threading
import time
import weakref
from typing import Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

from ..deadline import Deadline, TimeoutLike, format_duration
from ..errors import DistStoreError
from . import file_log
from .base import (
    DEFAULT_STORE_TIMEOUT,
    Store,
    ValueLike,
    check_key,
    check_keys,
    parse_counter,
    to_bytes,
    wrap_int64,
)

log = logging.getLogger("distlib.store.file")

#: Suffix of the liveness side file that every live distlib FileStore holds ``LOCK_SH`` on.
SIDECAR_SUFFIX = ".distlib-live"

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

_READ_CHUNK = 65536
_RD_FLAGS = os.O_RDONLY | os.O_CLOEXEC
_WR_FLAGS = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC
_RW_FLAGS = os.O_RDWR | os.O_CLOEXEC
_FILE_MODE = 0o644

_LOCK_SH = fcntl.LOCK_SH
_LOCK_EX = fcntl.LOCK_EX
_LOCK_UN = fcntl.LOCK_UN
_LOCK_NB = fcntl.LOCK_NB

#: flock() errors that mean "this file system cannot lock", not "try again".
_NO_LOCKING = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS}

_u32 = file_log._pack_u32
_replay = file_log.replay
_REFCOUNT = file_log.REFCOUNT_KEY
_CLEANUP = file_log.CLEANUP_KEY


# ------------------------------------------------------------------------------------------
# Mount table: is the store file on a file system whose locks every host honours?
# ------------------------------------------------------------------------------------------


class MountInfo(NamedTuple):
    """One line of ``/proc/self/mountinfo`` (proc(5)), the fields FileStore needs."""

    mount_point: str
    root: str
    fstype: str
    source: str
    mount_options: Tuple[str, ...]
    super_options: Tuple[str, ...]

    @property
    def options(self) -> Tuple[str, ...]:
        """Per-mount and per-superblock options together (NFS puts its own in the latter)."""
        return self.mount_options + self.super_options

    def describe(self) -> str:
        return f"{self.mount_point} ({self.fstype} from {self.source})"


_OCTAL_ESCAPE = re.compile(r"\\([0-7]{3})")


def _unescape(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as ``\\040`` etc."""
    if "\\" not in field:
        return field
    return _OCTAL_ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), field)


def parse_mountinfo(text: str) -> List[MountInfo]:
    """Parse mountinfo text; lines that do not have the documented shape are skipped.

    Shape: ``id parent major:minor root mount_point options [optional...] - fstype source
    super_options``; the optional fields end at the lone ``-``.
    """
    mounts: List[MountInfo] = []
    for line in text.splitlines():
        fields = line.split()
        try:
            dash = fields.index("-", 6)
        except ValueError:
            continue
        if len(fields) < dash + 3 or len(fields) < 6:
            continue
        mounts.append(
            MountInfo(
                mount_point=_unescape(fields[4]),
                root=_unescape(fields[3]),
                fstype=fields[dash + 1],
                source=_unescape(fields[dash + 2]),
                mount_options=tuple(fields[5].split(",")),
                super_options=tuple(fields[dash + 3].split(",")) if len(fields) > dash + 3 else (),
            )
        )
    return mounts


def find_mount(mounts: Sequence[MountInfo], path: str) -> Optional[MountInfo]:
    """The mount that holds ``path`` (an absolute, symlink-resolved path).

    The longest mount point that is ``path`` or a parent of it; among equal mount points the
    last one listed (a later mount hides an earlier one on the same directory).
    """
    best: Optional[MountInfo] = None
    for mount in mounts:
        point = mount.mount_point
        if point == "/" or path == point or path.startswith(point.rstrip("/") + "/"):
            if best is None or len(point) >= len(best.mount_point):
                best = mount
    return best


def lock_problem(mount: MountInfo) -> Optional[str]:
    """Why flock() on this mount would not exclude other hosts, or None when it would.

    NFS: ``nolock`` and ``local_lock=all`` / ``local_lock=flock`` keep flock() locks on the
    client (nfs(5)), so two hosts both "hold" the lock. ``local_lock=posix`` is fine: it
    keeps only fcntl() locks local, and FileStore uses flock(). Lustre's ``localflock``
    likewise makes flock() node-local.
    """
    options = mount.options
    if mount.fstype in ("nfs", "nfs4"):
        for bad in ("nolock", "local_lock=all", "local_lock=flock"):
            if bad in options:
                return (
                    f"mount option '{bad}': flock() locks on this NFS mount are local to this "
                    f"host, so FileStore processes on other hosts would not exclude each other "
                    f"and would corrupt the store file. Remount without 'nolock' and with "
                    f"'local_lock=none' (the default) and a working lock service: NFSv4, or "
                    f"NFSv3 with rpc.statd/lockd running on the client and the server"
                )
    if mount.fstype == "lustre" and "localflock" in options:
        return (
            "mount option 'localflock': flock() locks on this Lustre mount are local to this "
            "node. Mount with '-o flock' for cluster-wide locks"
        )
    return None


def mount_of(path: str, mountinfo_path: str = "/proc/self/mountinfo") -> Optional[MountInfo]:
    """The mount holding ``path``, or None when the mount table cannot be read."""
    try:
        with open(mountinfo_path, "r", encoding="utf-8", errors="surrogateescape") as f:
            text = f.read()
    except OSError as exc:
        log.debug("cannot read %s (%s): no mount check", mountinfo_path, exc)
        return None
    real = os.path.realpath(os.path.dirname(path) or "/")
    return find_mount(parse_mountinfo(text), real)


def check_mount(path: str, mountinfo_path: str = "/proc/self/mountinfo") -> Optional[MountInfo]:
    """Raise DistStoreError when ``path`` is on a mount whose locks are host-local."""
    mount = mount_of(path, mountinfo_path)
    if mount is None:
        return None
    problem = lock_problem(mount)
    if problem:
        raise DistStoreError(
            f"FileStore cannot safely use {path}: it is on mount {mount.mount_point} "
            f"(source {mount.source}, type {mount.fstype}) with {problem}."
        )
    if mount.fstype in ("nfs", "nfs4"):
        log.debug("store file %s is on NFS mount %s; locking options look right", path, mount.describe())
    return mount


def _lock_error(exc: OSError, path: str, what: str) -> DistStoreError:
    """The error for a flock() the file system refused: names the file, the mount, the fix."""
    name = errno.errorcode.get(exc.errno or 0, str(exc.errno))
    mount = mount_of(path)
    where = f"mount {mount.mount_point} (source {mount.source}, type {mount.fstype})" if mount else "its file system"
    hint = ""
    if mount is not None and mount.fstype in ("nfs", "nfs4"):
        hint = (
            " NFS needs a lock service: use NFSv4, or NFSv3 with rpc.statd/lockd running on "
            "the client and the server (and without 'nolock')."
        )
    return DistStoreError(
        f"FileStore: flock({what}) on {path} failed with {name} ({exc.strerror}): file "
        f"locking does not work on {where}, and FileStore cannot be used safely without it.{hint}"
    )


# ------------------------------------------------------------------------------------------
# Per-process state shared by every FileStore on one file
# ------------------------------------------------------------------------------------------


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


class _Log:
    """Everything a FileStore needs to operate and to close.

    Kept apart from the FileStore object so that ``weakref.finalize`` can close it when the
    FileStore is garbage collected (a finalizer must not hold the object it finalizes).
    """

    __slots__ = (
        "path",
        "sidecar_path",
        "world_size",
        "cache",
        "offset",
        "shared",
        "sidecar_fd",
        "identity",
        "pid",
        "closed",
        "chunk",
        "lock_wait_s",
    )

    def __init__(self, path: str, world_size: int, lock_wait_s: float) -> None:
        real = os.path.realpath(path)  # one side file and one mutex per file, however named
        self.path = path
        self.sidecar_path = real + SIDECAR_SUFFIX
        self.world_size = world_size
        self.cache: Dict[bytes, bytes] = {}
        self.offset = 0
        self.shared = _shared_for(real)
        self.sidecar_fd: Optional[int] = None
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

    def _lock(self, fd: int, op: int) -> None:
        """flock(op) with a bounded wait; a file system that cannot lock is a clear error."""
        try:
            fcntl.flock(fd, op | _LOCK_NB)
            return
        except BlockingIOError:
            pass
        except OSError as exc:
            if exc.errno in _NO_LOCKING:
                raise _lock_error(exc, self.path, "LOCK_EX" if op == _LOCK_EX else "LOCK_SH") from exc
            raise
        self._lock_contended(fd, op)

    def _lock_contended(self, fd: int, op: int) -> None:
        """Wait for a busy lock: yield a few times, then sleep 20 µs doubling to 2 ms.

        A blocking flock() cannot be given a deadline; polling with LOCK_NB can, so a process
        stopped while holding the lock (or a stuck NFS lock) gives an error, not a hang.
        """
        deadline = Deadline(self.lock_wait_s)
        delay = 20e-6
        tries = 0
        while True:
            if tries < 4:
                os.sched_yield()
            else:
                left = deadline.remaining()
                if left <= 0:
                    raise DistStoreError(
                        f"FileStore: could not lock store file {self.path} within "
                        f"{format_duration(deadline.seconds)}: another process held the lock "
                        f"all that time (a stopped or hung process, or a stuck NFS lock)"
                    )
                time.sleep(min(delay, left))
                delay = min(delay * 2, 0.002)
            tries += 1
            try:
                fcntl.flock(fd, op | _LOCK_NB)
                return
            except BlockingIOError:
                continue

    # -- reading ---------------------------------------------------------------------------------

    def _begin(self, flags: int, op: int) -> int:
        """Start an operation: open, flock(op), read the new records. Returns the fd.

        The caller holds the process mutex and must call ``_end(fd)``. This is the hot path
        of every operation, hence one method doing the three steps (each a few syscalls).
        """
        try:
            fd = os.open(self.path, flags, _FILE_MODE)
        except FileNotFoundError:
            raise self._vanished_error() from None
        try:
            self._lock(fd, op)
            data = os.pread(fd, self.chunk, self.offset)
            if data:
                self._absorb(fd, data)
        except BaseException:
            self._end(fd)
            raise
        return fd

    @staticmethod
    def _end(fd: int) -> None:
        """Unlock, then close.

        The explicit unlock matters: a process forked meanwhile shares the open file, and
        close() alone would leave the lock held through its copy. An unlock that fails is
        not reported (close() drops the lock anyway, and on an error path it must not hide
        the first error).
        """
        try:
            fcntl.flock(fd, _LOCK_UN)
        except OSError:
            pass
        os.close(fd)

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
            f"{self.sidecar_path} and start the job again."
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
        self._end(self._begin(_RD_FLAGS, _LOCK_SH))

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
            fd = self._begin(_WR_FLAGS, _LOCK_EX)
            try:
                self._append(fd, record)
                self.cache[fkey] = value
            finally:
                self._end(fd)

    def add(self, fkey: bytes, amount: int, key_name: str) -> int:
        if self.closed:
            self._ensure_open()
        with self.shared.mutex:
            fd = self._begin(_WR_FLAGS, _LOCK_EX)
            try:
                return self._add_locked(fd, fkey, amount, key_name)
            finally:
                self._end(fd)

    def _add_locked(self, fd: int, fkey: bytes, amount: int, key_name: str) -> int:
        old = self.cache.get(fkey)
        if old is None:
            number = amount
        elif old.isdigit() and len(old) < 19:  # the usual canonical counter: skip strtoll rules
            number = int(old) + amount
        else:
            number = parse_counter(old, key_name) + amount
        if not -0x8000000000000000 <= number <= 0x7FFFFFFFFFFFFFFF:
            number = wrap_int64(number)
        value = b"%d" % number
        self._append(fd, _u32(len(fkey)) + fkey + _u32(len(value)) + value)
        self.cache[fkey] = value
        return number

    def compare_set(self, fkey: bytes, expected: bytes, desired: bytes) -> bytes:
        if self.closed:
            self._ensure_open()
        with self.shared.mutex:
            fd = self._begin(_WR_FLAGS, _LOCK_EX)
            try:
                current = self.cache.get(fkey)
                if current is None:
                    if expected:
                        return expected
                elif current != expected:
                    return current
                self._append(fd, _u32(len(fkey)) + fkey + _u32(len(desired)) + desired)
                self.cache[fkey] = desired
                return desired
            finally:
                self._end(fd)

    def delete(self, fkey: bytes) -> None:
        if self.closed:
            self._ensure_open()
        tomb = b"-" + fkey
        with self.shared.mutex:
            fd = self._begin(_RW_FLAGS, _LOCK_EX)  # torch: O_RDWR without O_CREAT
            try:
                self._append(fd, _u32(len(tomb)) + tomb + b"\0\0\0\0")
                self.cache.pop(fkey, None)
            finally:
                self._end(fd)

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
                self._join_sidecar(fd)
                try:
                    self._add_locked(fd, _REFCOUNT, 1, "refcount/")
                except BaseException:
                    self._leave_sidecar()
                    raise
            finally:
                self._end(fd)
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
                self._lock(fd, _LOCK_EX)
                st = os.fstat(fd)
                try:
                    now = os.stat(self.path)
                except FileNotFoundError:
                    now = None
            except BaseException:
                self._end(fd)
                raise
            if now is not None and (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):
                self.identity = (st.st_dev, st.st_ino)
                return fd
            self._end(fd)
            if deadline.expired():
                raise DistStoreError(
                    f"FileStore: store file {self.path} kept being removed and created again "
                    f"for {format_duration(deadline.seconds)} while opening it"
                )
            log.debug("%s was unlinked while we waited for its lock; opening it again", self.path)

    # -- the liveness side file ------------------------------------------------------------------

    def _join_sidecar(self, fd: int) -> None:
        """Detect a store file left by a crashed distlib run; then register as a live user.

        ``<file>.distlib-live`` holds the number of distlib users that joined and have not
        closed yet, and every live distlib FileStore holds ``flock(LOCK_SH)`` on it, which
        the kernel drops when the process dies (SIGKILL included). Under the store file's
        LOCK_EX (held by the caller): if ``LOCK_EX|LOCK_NB`` on the side file succeeds, no
        distlib user is alive; if the count is still above 0 then some user died without
        closing, and if the store file holds records they are that dead run's: error.

        A store file without a side file was created by torch (whose processes hold no
        liveness lock), or its distlib users all closed cleanly (the last one removes the
        side file): nothing to tell, so join. Counting users (not just testing the lock)
        keeps live *torch* users of a shared file from looking like a crash.
        """
        try:
            sfd = os.open(self.sidecar_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, _FILE_MODE)
        except OSError as exc:
            log.warning(
                "cannot open the liveness file %s (%s): stale-file detection is off for %s",
                self.sidecar_path, exc, self.path,
            )
            return
        try:
            users = _read_users(sfd, self.sidecar_path)
            if self.shared.live == 0 and self._sidecar_unheld(sfd):
                if users > 0 and self.offset > 0:
                    raise self._stale_error(fd, users)
                if users > 0:
                    log.info(
                        "%s counted %d user(s) of a store file that is now empty; starting afresh",
                        self.sidecar_path, users,
                    )
                users = 0
            self._lock(sfd, _LOCK_SH)  # a downgrade when we hold LOCK_EX; nobody else can
            _write_users(sfd, users + 1)
        except BaseException:
            os.close(sfd)
            raise
        self.sidecar_fd = sfd
        self.shared.live += 1

    def _sidecar_unheld(self, sfd: int) -> bool:
        """True when no live distlib FileStore holds the side file (we now hold LOCK_EX)."""
        try:
            fcntl.flock(sfd, _LOCK_EX | _LOCK_NB)
            return True
        except BlockingIOError:
            return False
        except OSError as exc:
            if exc.errno in _NO_LOCKING:
                raise _lock_error(exc, self.sidecar_path, "LOCK_EX") from exc
            raise

    def _stale_error(self, fd: int, users: int) -> DistStoreError:
        image = os.pread(fd, self.offset, 0)
        records = sum(1 for _ in file_log.iter_records(image))
        refcount = self.cache.get(_REFCOUNT, b"0").decode("ascii", "replace")
        cleanup = self.cache.get(_CLEANUP, b"0").decode("ascii", "replace")
        return DistStoreError(
            f"FileStore: store file {self.path} holds {records} records from an earlier run "
            f"whose processes are gone (refcount {refcount}, cleanup {cleanup}; {users} distlib "
            f"user(s) never closed it: killed or crashed). Joining it would mix that run's keys "
            f"into this one. Remove {self.path} and {self.sidecar_path} and start again."
        )

    def _leave_sidecar(self) -> None:
        """Undo ``_join_sidecar`` (the refcount record could not be written)."""
        self._leave_users(False)
        self._release_sidecar()

    def _release_sidecar(self) -> None:
        sfd = self.sidecar_fd
        if sfd is None:
            return
        self.sidecar_fd = None
        self.shared.live = max(0, self.shared.live - 1)
        try:
            fcntl.flock(sfd, _LOCK_UN)
        finally:
            os.close(sfd)

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
            if self.sidecar_fd is not None:
                os.close(self.sidecar_fd)
                self.sidecar_fd = None
            return
        with self.shared.mutex:
            try:
                if os.path.exists(self.path):  # torch: a file already gone means nothing to do
                    self._close_locked()
            finally:
                self._release_sidecar()

    def _close_locked(self) -> None:
        try:
            fd = os.open(self.path, _RW_FLAGS)
        except FileNotFoundError:
            return
        try:
            self._lock(fd, _LOCK_EX)
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
            self._leave_users(remove)  # the side file goes first, see _leave_users
            if remove:
                _unlink(self.path)
                log.debug("last user closed %s (world size %d): removed", self.path, self.world_size)
            else:
                log.debug("closed %s (refcount %d, cleanup %d)", self.path, refcount, finished)
            self._release_sidecar()
        finally:
            self._end(fd)

    def _leave_users(self, removing_store: bool) -> None:
        """Count this user out of the side file (caller holds the store file's LOCK_EX).

        At 0 users the side file says nothing a missing one would not, so it is removed
        (before the store file, so that a joiner never pairs a new store file with an old
        side file); it therefore only outlives its users when one of them died.
        """
        if self.sidecar_fd is None:
            return
        users = max(0, _read_users(self.sidecar_fd, self.sidecar_path) - 1)
        if users == 0 or removing_store:
            _unlink(self.sidecar_path)
        else:
            _write_users(self.sidecar_fd, users)


def _unlink(path: str) -> None:
    """Best effort, as torch: a file we cannot remove is logged, not fatal."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("could not remove %s: %s", path, exc)


def _first_missing_dir(directory: str) -> str:
    """The outermost missing directory on the way to ``directory`` (for error texts)."""
    missing = directory
    parent = os.path.dirname(missing)
    while parent != missing and not os.path.isdir(parent):
        missing, parent = parent, os.path.dirname(parent)
    return missing


def _read_users(sfd: int, name: str) -> int:
    raw = os.pread(sfd, 64, 0)
    text = raw.strip()
    if not text:
        return 0
    try:
        return max(0, int(text.split()[0]))
    except ValueError:
        log.warning("liveness file %s holds %r, not a count; reading it as 0", name, raw[:32])
        return 0


def _write_users(sfd: int, users: int) -> None:
    data = b"%d\n" % users
    os.pwrite(sfd, data, 0)
    os.ftruncate(sfd, len(data))


def _finalize(log_: _Log) -> None:
    """The destructor (garbage collection or interpreter exit): close, never raise."""
    try:
        log_.close()
    except Exception as exc:  # a destructor must not raise; say what went wrong instead
        log.warning("closing FileStore %s failed: %s", log_.path, exc)


# ------------------------------------------------------------------------------------------
# FileStore
# ------------------------------------------------------------------------------------------


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
        check_mount(path)
        self._log = _Log(path, world_size, max(self._timeout_s, MIN_LOCK_WAIT_S))
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
        self._log._ensure_open()
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
        """Append a tombstone; always True, as torch (it does not look whether k existed)."""
        self._log.delete(_file_key(key))
        return True

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
                missing = [k for k, f in zip(keys, fkeys) if f not in cache]
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


__all__ = [
    "FileStore",
    "MountInfo",
    "parse_mountinfo",
    "find_mount",
    "lock_problem",
    "check_mount",
    "SIDECAR_SUFFIX",
]
