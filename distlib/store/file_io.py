"""``LogFile``: the store file as one FileStore sees it, and every operation's I/O cycle.

The store file is torch's append-only record log (the bytes: ``file_log.py``). Each
operation opens the file, takes a whole-file ``flock`` (``LOCK_EX`` to write, ``LOCK_SH`` to
read; ``file_locks.py``), reads the records it has not seen yet from its cached offset up to
EOF, appends at most one record per change, unlocks and closes (docs/wire-protocol.md,
"FileStore"). Reads never trust ``st_size`` or ``mtime`` (NFS caches them): they read until
``read()`` returns nothing, under the lock.

Joining and closing (torch's refcount and cleanup records, the liveness side file) are
``file_join.py``'s ``JoinedFile``, which holds a LogFile and uses its public methods only
(``open_for_join``, ``open_for_close``, ``catch_up``, ``add_in_cycle``, ``count_records``,
``forget``; each says what the caller must hold).

Damage is named, never misread: under the lock no writer is mid-record, so bytes that do not
form a whole record are reported with their byte offset; a file truncated, replaced or
removed while in use is an error that says so. Every read starts a few bytes (``_TAIL``)
before the offset already read and compares them with what was there before: a file that
shrank below that offset, or was rewritten, is caught by the read every operation does
anyway. Reads are bounded (parsed as they arrive, ``_READ_MAX`` bytes at most at a time, a
record's length fields checked against ``file_log``'s limits), and only a regular file is
joined, so no path makes a reader allocate without bound or read forever. Every failing
system call becomes a DistStoreError naming the file, the operation and the errno
(``file_locks.os_error``).
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from typing import Dict, List, Optional, Tuple

from ..errors import DistStoreError
from ..exposure import symlink_refusal
from . import file_log
from .base import add_to_counter, compare_set_refusal
from .file_locks import LOCK_EX, LOCK_SH, lock, os_error, unlock_close
from .file_sidecar import RENEW_S, Liveness

log = logging.getLogger("distlib.store.file")

_READ_CHUNK = 65536
#: The largest single read while catching up (reads double from ``_READ_CHUNK`` as data
#: arrives): a big file is read in few calls, and no read allocates more than this whatever
#: a length field says.
_READ_MAX = 16 * 1024 * 1024
#: Bytes before the read offset that every read takes again, to see that they are still the
#: ones read before (the file was not truncated or rewritten under us).
_TAIL = 16
#: O_NONBLOCK: opening a named pipe that replaced the file must not block (a no-op for
#: regular files).
_RD_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK
_WR_FLAGS = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC
_RW_FLAGS = os.O_RDWR | os.O_CLOEXEC
_FILE_MODE = 0o644
_OPENING = {
    _RD_FLAGS: "opening (for reading)",
    _WR_FLAGS: "opening (for writing, creating it if missing)",
    _RW_FLAGS: "opening (for writing)",
}

_u32 = file_log._pack_u32
_replay = file_log.replay
#: Writers refuse what readers would call damage; ``-`` + the file key must fit too.
_MAX_WRITE_KEY = file_log.MAX_KEY - 1
_MAX_VALUE = file_log.MAX_VALUE


class _Shared:
    """One per file per process: a mutex and how many live FileStores here use the file.

    The mutex serialises operations of this process's FileStore objects on the file (threads,
    clones), so correctness inside one process never depends on how a file system implements
    flock() between open files of the same process (NFS emulates it with POSIX locks).
    ``live`` lets a new FileStore skip the stale-file check when this process already uses
    the file (it is live by definition). ``users`` counts the LogFiles that hold this record:
    the last to let go (``_let_go``) removes it from ``_SHARED``, so a process that opens and
    closes stores on ever new paths does not keep a record per path (issue 37).
    """

    __slots__ = ("mutex", "live", "users")

    def __init__(self) -> None:
        self.mutex = threading.Lock()
        self.live = 0
        self.users = 0


_SHARED: Dict[str, _Shared] = {}
_SHARED_GUARD = threading.Lock()


def _shared_for(real_path: str) -> _Shared:
    with _SHARED_GUARD:
        shared = _SHARED.get(real_path)
        if shared is None:
            shared = _SHARED[real_path] = _Shared()
        shared.users += 1
        return shared


def _let_go(real_path: str, shared: _Shared) -> None:
    with _SHARED_GUARD:
        shared.users -= 1
        if shared.users <= 0 and _SHARED.get(real_path) is shared:
            del _SHARED[real_path]


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
    """One FileStore's view of the store file (cache, offset, liveness lock) and its operations.

    Kept apart from the FileStore object so that ``weakref.finalize`` can close it when the
    FileStore is garbage collected (a finalizer must not hold the object it finalizes).

    The join (file_join.py) sets three attributes: ``nofollow`` before the first open,
    ``identity`` (the joined file's device and inode) once the file is locked, and ``closed``.
    ``shared.mutex`` is the process's lock on the file, held around every cycle.
    """

    __slots__ = (
        "path",
        "world_size",
        "cache",
        "offset",
        "tail",
        "shared",
        "liveness",
        "identity",
        "pid",
        "closed",
        "chunk",
        "lock_wait_s",
        "nofollow",
        "real_path",
        "holds_shared",
    )

    def __init__(self, path: str, world_size: int, lock_wait_s: float) -> None:
        real = os.path.realpath(path)  # one side file and one mutex per file, however named
        self.path = path
        self.world_size = world_size
        self.cache: Dict[bytes, bytes] = {}
        self.offset = 0
        self.tail = b""  # the last _TAIL bytes before offset
        self.real_path = real
        self.shared = _shared_for(real)
        self.holds_shared = True  # counted in shared.users until let_go()
        self.liveness = Liveness(path, real, self.shared)
        self.identity: Tuple[int, int] = (0, 0)
        self.pid = os.getpid()
        self.closed = False
        self.chunk = _READ_CHUNK
        self.lock_wait_s = lock_wait_s
        #: O_NOFOLLOW when the file's directory is writable by every user (set at join:
        #: exposure.check_store_path), else 0; added to every open of the path.
        self.nofollow = 0

    # -- opening and locking -------------------------------------------------------------------

    def _open(self, flags: int) -> int:
        try:
            return os.open(self.path, flags | self.nofollow, _FILE_MODE)
        except OSError as exc:
            raise self._open_error(exc, flags) from None

    def open_for_join(self) -> int:
        """Open the path for writing, creating the file if it is missing (no lock yet)."""
        return self._open(_WR_FLAGS)

    def open_for_close(self) -> Optional[int]:
        """Open the path for writing, not creating it: None when the file is gone (no lock)."""
        try:
            return os.open(self.path, _RW_FLAGS | self.nofollow)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise os_error(exc, self.path, "closing: " + _OPENING[_RW_FLAGS]) from exc

    def let_go(self) -> None:
        """This view of the file is done with (closed, or its join failed): the process's
        record of the file (its mutex) goes with the last view that holds it. Twice: nothing."""
        if self.holds_shared:
            self.holds_shared = False
            _let_go(self.real_path, self.shared)

    def forget(self) -> None:
        """Drop what was read of the file: the next read starts at its first byte."""
        self.cache.clear()
        self.offset, self.tail = 0, b""

    def count_records(self, fd: int) -> int:
        """The records before ``offset`` in the file ``fd`` (the caller holds its lock and has
        caught up), counted in bounded reads: the file may be big. Raises OSError."""
        records = 0
        at = 0
        while at < self.offset:
            image = os.pread(fd, min(self.offset - at, _READ_MAX), at)
            if not image:
                break
            whole = file_log.record_end(image)
            if whole:
                records += sum(1 for _ in file_log.iter_records(image[:whole]))
                at += whole
            else:  # one record longer than a read: skip it by its header
                records += 1
                at += file_log.record_need(image, 0)
        return records

    def _open_error(self, exc: OSError, flags: int) -> DistStoreError:
        if isinstance(exc, FileNotFoundError):
            return self._vanished_error()
        if exc.errno == errno.ELOOP and self.nofollow:
            return DistStoreError(symlink_refusal(self.path))
        return os_error(exc, self.path, _OPENING[flags])

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
            fd = os.open(self.path, flags | self.nofollow, _FILE_MODE)
        except OSError as exc:
            raise self._open_error(exc, flags) from None
        try:  # catch_up, inlined: this is every operation's read
            lock(fd, op, self.path, self.lock_wait_s)
            tail = self.tail
            data = os.pread(fd, len(tail) + self.chunk, self.offset - len(tail))
            if data != tail:
                self._absorb_after(fd, data, tail)
        except BaseException as exc:
            unlock_close(fd)
            if isinstance(exc, OSError):
                raise os_error(exc, self.path, "reading") from exc
            raise
        return fd

    def catch_up(self, fd: int) -> None:
        """Apply the records after ``offset`` (caller holds the process mutex and the file's lock).

        The read starts ``len(tail)`` bytes early: getting back exactly ``tail`` (the common
        case) means nothing new; fewer bytes, or other ones, mean the file shrank or was
        rewritten under us.
        """
        tail = self.tail
        try:
            data = os.pread(fd, len(tail) + self.chunk, self.offset - len(tail))
            if data != tail:
                self._absorb_after(fd, data, tail)
        except OSError as exc:
            raise os_error(exc, self.path, "reading") from exc

    def _absorb_after(self, fd: int, data: bytes, tail: bytes) -> None:
        """``data`` was read from ``len(tail)`` bytes before ``offset`` and is not just
        ``tail``: new records after it, or a file that shrank or was rewritten."""
        if not data.startswith(tail):
            if len(data) < len(tail):  # the file ends before our offset
                raise self._moved_error(fd, self.offset - len(tail) + len(data) if data else None)
            raise self._moved_error(fd, None, rewritten=True)
        self._absorb(fd, data, len(tail))

    def _absorb(self, fd: int, data: bytes, skip: int) -> None:
        """Apply the records in ``data[skip:]`` (``data[skip]`` is at ``offset``), reading on
        to EOF.

        Records are parsed as they arrive, so memory holds one read's unparsed rest, and a
        record that is damage whatever follows (an empty key, zeros, a length beyond the
        limits) stops the reading at once: a file that yields endless zeros or noise is
        reported at its first bad record, not read to its end. EOF is where read() returns
        nothing, never ``st_size``; under the lock no writer is mid-record, so a record cut
        short at EOF is damage too. Both are reported with the byte offset.
        """
        cache = self.cache
        base = self.offset - skip  # file offset of data[0]
        pos = skip
        step = self.chunk
        while True:
            end = len(data)
            done = _replay(data, cache, pos)
            if done > pos:
                self.offset = base + done
                self.tail = data[done - _TAIL : done] if done >= _TAIL else (self.tail + data[pos:done])[-_TAIL:]
            if done < end:
                problem = file_log.record_problem(data, done)
                if problem is not None:
                    raise self._damage_error(base + done, problem)
                want = file_log.record_need(data, done) - (end - done)
                pieces = [data[done:]]
            else:
                want = 0
                pieces = []
            at = base + end  # read on from here
            have = 0
            while True:  # at least one read; more while the record at ``done`` needs them
                # Reads grow only as data arrives: a length field announcing 200 MB in a
                # 100-byte file costs one chunk-sized read, not a 200 MB buffer.
                more = os.pread(fd, step, at + have)
                if not more:
                    break
                pieces.append(more)
                have += len(more)
                step = min(step * 2, _READ_MAX)
                if have >= want:
                    break
            if not have:  # EOF
                if done < end:
                    raise self._damage_error(base + done, file_log.describe_damage(data, done))
                return
            data = pieces[0] if len(pieces) == 1 else b"".join(pieces)
            base += done
            pos = 0

    def _damage_error(self, at: int, what: str) -> DistStoreError:
        return DistStoreError(
            f"FileStore: store file {self.path} is damaged at byte {at}: {what}. FileStore "
            f"writers append whole records under an exclusive lock, so these bytes come from a "
            f"process that died in the middle of a write, or from something other than a "
            f"FileStore (another program, a copy that padded the file). Remove {self.path} and "
            f"{self.liveness.path} and start the job again."
        )

    def _append(self, fd: int, record: bytes) -> None:
        """Append one record at the end we read to (caller holds LOCK_EX and caught up).

        The end is also checked with lseek: a file shorter than what we already read was
        truncated or replaced behind our back, and appending would corrupt it.
        """
        try:
            end = os.lseek(fd, 0, os.SEEK_END)
        except OSError as exc:
            raise os_error(exc, self.path, "finding the end (lseek) of") from exc
        if end != self.offset:
            raise self._moved_error(fd, end)
        try:
            written = os.write(fd, record)
            while written < len(record):
                written += os.write(fd, record[written:])
        except OSError as exc:
            self._roll_back(fd, end)
            raise os_error(exc, self.path, f"appending a {len(record)}-byte record (at byte {end}) to") from exc
        self.offset = end + written
        self.tail = record[-_TAIL:] if written >= _TAIL else (self.tail + record)[-_TAIL:]

    def _roll_back(self, fd: int, end: int) -> None:
        """Cut a half-written record off (still under our lock), so the log stays whole."""
        try:
            os.ftruncate(fd, end)
        except OSError as exc:  # pragma: no cover - a disk error on top of a disk error
            log.error("could not roll back a partial record in %s at byte %d: %s", self.path, end, exc)

    def _moved_error(self, fd: int, size: Optional[int], rewritten: bool = False) -> DistStoreError:
        """The file under ``fd`` is not the one read so far: replaced, truncated, rewritten,
        or longer than the reading found. ``size`` is its length when known (else fstat's)."""
        path = self.path
        try:
            st: Optional[os.stat_result] = os.fstat(fd)
        except OSError:
            st = None
        if st is not None and (st.st_dev, st.st_ino) != self.identity:
            return DistStoreError(
                f"FileStore: store file {path} was replaced by another file while this FileStore "
                f"was using it (removed and created again): another job reused this path? It "
                f"had read {self.offset} bytes of the old file. Nothing was written."
            )
        if size is None and st is not None:
            size = st.st_size
        if size is not None and size < self.offset:
            return DistStoreError(
                f"FileStore: store file {path} was truncated from {self.offset} to {size} bytes "
                f"under us: another job reused this file? (FileStore files only grow; this "
                f"FileStore had read {self.offset} bytes of it; or it was removed and created "
                f"again.) Nothing was written."
            )
        if rewritten or size is None:
            return DistStoreError(
                f"FileStore: store file {path} was rewritten under us: the bytes before byte "
                f"{self.offset} are no longer the ones this FileStore read there (another job "
                f"reused this file?). Nothing was written."
            )
        return DistStoreError(
            f"FileStore: store file {path} ends at byte {size} but this FileStore has read "
            f"{self.offset} bytes of it: reading stopped short of the end (something writes to "
            f"it without the lock, or the file system does not keep locked files coherent). "
            f"Nothing was written."
        )

    def check_identity(self) -> None:
        """Raise when the path no longer names the file we joined (removed or replaced).

        Called between polls of get/wait (a poll sleeps ≥ 1 ms, so the stat is free there),
        so a waiter on a file that went away fails with the reason instead of timing out.
        Every ``RENEW_S`` it also renews the liveness lock (``Liveness.renew``).
        """
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            raise self._vanished_error() from None
        except OSError as exc:
            raise os_error(exc, self.path, "checking (stat)") from exc
        if (st.st_dev, st.st_ino) != self.identity:
            raise DistStoreError(
                f"FileStore: store file {self.path} was replaced by another file while this "
                f"FileStore was using it (removed and created again)."
            )
        now = time.monotonic()
        if now - self.liveness.renewed >= RENEW_S and os.getpid() == self.pid:
            # (a forked copy must not: its descriptor shares the parent's lock, close() says why)
            with self.shared.mutex:
                self.liveness.renew(now)

    # -- operations (each: one open/lock/read/[write]/unlock/close cycle) ------------------------

    def ensure_open(self) -> None:
        """Raise when this FileStore is closed."""
        if self.closed:
            raise DistStoreError(f"FileStore {self.path} is closed")

    def _refresh_locked(self) -> None:
        """Bring the cache up to date under LOCK_SH (caller holds the process mutex)."""
        unlock_close(self._begin(_RD_FLAGS, LOCK_SH))

    def lookup(self, fkey: bytes) -> Optional[bytes]:
        """The current value of ``fkey`` (None when absent), read and looked up atomically."""
        if self.closed:
            self.ensure_open()
        with self.shared.mutex:
            self._refresh_locked()
            return self.cache.get(fkey)

    def has_all(self, fkeys: List[bytes]) -> bool:
        if self.closed:
            self.ensure_open()
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
            self.ensure_open()
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
            self.ensure_open()
        with self.shared.mutex:
            self._refresh_locked()
            return list(self.cache)

    def set(self, fkey: bytes, value: bytes) -> None:
        if self.closed:
            self.ensure_open()
        if len(fkey) > _MAX_WRITE_KEY or len(value) > _MAX_VALUE:
            _refuse(fkey, value)
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
            self.ensure_open()
        if len(fkey) > _MAX_WRITE_KEY:
            _refuse(fkey, b"")
        with self.shared.mutex:
            fd = self._begin(_WR_FLAGS, LOCK_EX)
            try:
                return self.add_in_cycle(fd, fkey, amount, key_name)
            finally:
                unlock_close(fd)

    def add_in_cycle(self, fd: int, fkey: bytes, amount: int, key_name: str) -> int:
        """ADD inside a cycle: the caller holds the process mutex and ``LOCK_EX`` on ``fd``, and
        has caught up; returns the new value."""
        number = add_to_counter(self.cache.get(fkey), amount, key_name)
        value = b"%d" % number
        self._append(fd, _u32(len(fkey)) + fkey + _u32(len(value)) + value)
        self.cache[fkey] = value
        return number

    def compare_set(self, fkey: bytes, expected: bytes, desired: bytes) -> bytes:
        if self.closed:
            self.ensure_open()
        if len(fkey) > _MAX_WRITE_KEY or len(desired) > _MAX_VALUE:
            _refuse(fkey, desired)
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
            self.ensure_open()
        if len(fkey) > _MAX_WRITE_KEY:
            _refuse(fkey, b"")
        tomb = b"-" + fkey
        with self.shared.mutex:
            fd = self._begin(_RW_FLAGS, LOCK_EX)  # torch: O_RDWR without O_CREAT
            try:
                self._append(fd, _u32(len(tomb)) + tomb + b"\0\0\0\0")
                return self.cache.pop(fkey, None) is not None
            finally:
                unlock_close(fd)


def _refuse(fkey: bytes, value: bytes) -> None:
    """Raise for a record no reader would accept (``file_log``'s limits), before any I/O."""
    raise ValueError(
        f"FileStore: refused to write a {len(fkey) - 1}-byte key with a {len(value)}-byte value: "
        f"keys may have at most {_MAX_WRITE_KEY - 1} bytes (UTF-8) and values {_MAX_VALUE} bytes, "
        f"and a reader takes a larger record for damage. Nothing was written."
    )


def _first_missing_dir(directory: str) -> str:
    """The outermost missing directory on the way to ``directory`` (for error texts)."""
    missing = directory
    parent = os.path.dirname(missing)
    while parent != missing and not os.path.isdir(parent):
        missing, parent = parent, os.path.dirname(parent)
    return missing
