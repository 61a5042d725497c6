"""``JoinedFile``: a store file this process has joined, with torch's constructor and destructor.

Joining (the FileStore constructor) opens the file, creating it, under its ``LOCK_EX``,
re-opening the path when a closing user unlinked it while we waited for the lock; checks
that it is a regular file; refuses a file a crashed earlier run left (``file_sidecar.py``;
looked at twice, ``SETTLE_S`` apart, so live NFS users that lost their locks can renew them);
and adds 1 to ``refcount/``. Closing (``close()``, the destructor, interpreter exit) adds 1
to ``cleanup/`` and -1 to ``refcount/`` in one locked cycle, and unlinks the file when the
refcount reaches 0, ``world_size >= 0`` and ``cleanup >= world_size`` (torch's rule).

Kept apart from the operations' I/O cycle (file_io.py) because it runs twice per store,
not once per operation, and holds the lifecycle rules (refcounts, stale runs) in one place.
``JoinedFile`` holds the store's ``LogFile`` (``log``) and uses its public methods only; it is
the object a FileStore talks to (file_guard.py wraps it on NFS): its own ``join`` and
``close``, and the log's operations, passed on.
"""

from __future__ import annotations

import logging
import os
import stat
import time
from typing import List, Optional

from ..deadline import Deadline, format_duration
from ..errors import DistStoreError
from ..exposure import check_store_path
from . import file_log
from .file_io import LogFile
from .file_locks import LOCK_EX, describe_kind, lock, os_error, unlink, unlock_close
from .file_sidecar import SETTLE_S, StaleSuspected

log = logging.getLogger("distlib.store.file")

_REFCOUNT = file_log.REFCOUNT_KEY
_CLEANUP = file_log.CLEANUP_KEY


class JoinedFile:
    """A FileStore's store file: the constructor's ``join``, the destructor's ``close``, and
    the operations of ``log`` (``lookup``, ``has_all``, ``has_user_keys``, ``snapshot``,
    ``set``, ``add``, ``compare_set``, ``delete``, ``check_identity``, ``ensure_open``)."""

    __slots__ = ("log",)

    def __init__(self, path: str, world_size: int, lock_wait_s: float) -> None:
        self.log = LogFile(path, world_size, lock_wait_s)

    # -- the operations: the log's ---------------------------------------------------------------

    def lookup(self, fkey: bytes) -> Optional[bytes]:
        return self.log.lookup(fkey)

    def has_all(self, fkeys: List[bytes]) -> bool:
        return self.log.has_all(fkeys)

    def has_user_keys(self, keys: List[str]) -> bool:
        return self.log.has_user_keys(keys)

    def snapshot(self) -> List[bytes]:
        return self.log.snapshot()

    def set(self, fkey: bytes, value: bytes) -> None:
        self.log.set(fkey, value)

    def add(self, fkey: bytes, amount: int, key_name: str) -> int:
        return self.log.add(fkey, amount, key_name)

    def compare_set(self, fkey: bytes, expected: bytes, desired: bytes) -> bytes:
        return self.log.compare_set(fkey, expected, desired)

    def delete(self, fkey: bytes) -> bool:
        return self.log.delete(fkey)

    def check_identity(self) -> None:
        self.log.check_identity()

    def ensure_open(self) -> None:
        self.log.ensure_open()

    @property
    def path(self) -> str:
        return self.log.path

    @property
    def world_size(self) -> int:
        return self.log.world_size

    @property
    def closed(self) -> bool:
        return self.log.closed

    @property
    def cache(self):
        """The keys and values read so far (a waiter's timeout error names the missing ones)."""
        return self.log.cache

    @property
    def lock_wait_s(self) -> float:
        """How long an operation waits for the file's lock (the store timeout, at least 30 s)."""
        return self.log.lock_wait_s

    @lock_wait_s.setter
    def lock_wait_s(self, seconds: float) -> None:
        self.log.lock_wait_s = seconds

    # -- joining: constructor --------------------------------------------------------------------

    def join(self) -> None:
        """The constructor's work: create/open the file, check it, refcount += 1.

        All under the file's LOCK_EX, so joiners and closers of every process (torch's too)
        are serialised: the stale check and the refcount see a settled file.
        """
        lf = self.log
        try:
            lf.nofollow = check_store_path(lf.path)  # warnings (once), O_NOFOLLOW in a world-writable directory
            try:
                self._join_once(settled=False)
            except StaleSuspected as suspected:
                log.warning(
                    "FileStore %s: its side file counts %d user(s) but none holds the liveness lock: "
                    "a crashed run, or live users on NFS whose locks a server restart took; looking "
                    "again in %s, after live users have renewed their locks",
                    lf.path, suspected.users, format_duration(SETTLE_S),
                )
                time.sleep(SETTLE_S)
                lf.forget()  # nothing was joined: read the file afresh
                self._join_once(settled=True)
        except BaseException:
            lf.closed = True
            lf.let_go()  # the store was never made: its record of the file goes with it
            raise
        log.debug("joined %s (refcount now %s)", lf.path, lf.cache.get(_REFCOUNT))

    def _join_once(self, settled: bool) -> None:
        lf = self.log
        with lf.shared.mutex:
            fd = self._open_locked_for_join()
            try:
                lf.catch_up(fd)
                stale = (lambda users: self._stale_error(fd, users)) if lf.offset > 0 else None
                lf.liveness.join(stale, lf.lock_wait_s, lf.nofollow, settled)
                try:
                    lf.add_in_cycle(fd, _REFCOUNT, 1, "refcount/")
                except BaseException:
                    lf.liveness.count_out(False)
                    lf.liveness.release()
                    raise
            finally:
                unlock_close(fd)

    def _open_locked_for_join(self) -> int:
        """Open (creating) and LOCK_EX the file the path names *after* the lock is granted.

        A closing user may unlink the file while we wait for its lock; then the inode we
        locked is gone from the directory and we must open the path again (torch does not
        check, and can end up alone on an unlinked file).
        """
        lf = self.log
        deadline = Deadline(lf.lock_wait_s)
        while True:
            fd = lf.open_for_join()
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    raise DistStoreError(
                        f"FileStore: {lf.path} is {describe_kind(st.st_mode)}, not a regular "
                        f"file: a store file must be a regular file (a device or a pipe can "
                        f"yield endless data, or none, and cannot hold records). Give the path "
                        f"of a file on a local or shared file system"
                    )
                lock(fd, LOCK_EX, lf.path, lf.lock_wait_s)
                try:
                    now = os.stat(lf.path)
                except FileNotFoundError:
                    now = None
            except OSError as exc:
                unlock_close(fd)
                raise os_error(exc, lf.path, "checking (fstat/stat)") from exc
            except BaseException:
                unlock_close(fd)
                raise
            if now is not None and (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):
                lf.identity = (st.st_dev, st.st_ino)
                return fd
            unlock_close(fd)
            if deadline.expired():
                raise DistStoreError(
                    f"FileStore: store file {lf.path} kept being removed and created again "
                    f"for {format_duration(deadline.seconds)} while opening it"
                )
            log.debug("%s was unlinked while we waited for its lock; opening it again", lf.path)

    def _stale_error(self, fd: int, dead_users: int) -> DistStoreError:
        """The store file ``fd`` (locked, read to its end) holds a dead run's records:
        ``Liveness.join`` found its distlib users gone without closing."""
        lf = self.log
        try:
            records = lf.count_records(fd)
        except OSError as exc:
            return os_error(exc, lf.path, "reading (to report a dead run's records in)")
        refcount = lf.cache.get(_REFCOUNT, b"0").decode("ascii", "replace")
        cleanup = lf.cache.get(_CLEANUP, b"0").decode("ascii", "replace")
        return DistStoreError(
            f"FileStore: store file {lf.path} holds {records} records from an earlier run "
            f"whose processes are gone (refcount {refcount}, cleanup {cleanup}; {dead_users} distlib "
            f"user(s) never closed it: killed or crashed, or their host lost). Joining it would mix "
            f"that run's keys into this one. (If this job's own ranks wrote them, one of them died "
            f"before this rank joined: read its log.) Remove {lf.path} and {lf.liveness.path} "
            f"and start again."
        )

    # -- closing: destructor -------------------------------------------------------------------

    def close(self) -> None:
        """torch's destructor: cleanup/ += 1, refcount/ -= 1, maybe unlink; then let go.

        Both records are appended in one locked cycle (torch takes two; the bytes are the
        same). The side file's user count is lowered, and the liveness lock released, while
        the store file's LOCK_EX is still held, so a joiner never sees a dead-looking user.
        """
        lf = self.log
        if lf.closed:
            return
        lf.closed = True
        if os.getpid() != lf.pid:
            # A forked copy: the parent owns this user (and the shared liveness lock).
            lf.liveness.forget_in_fork()
            lf.let_go()
            return
        try:
            with lf.shared.mutex:
                try:
                    if os.path.exists(lf.path):  # torch: a file already gone means nothing to do
                        self._close_locked()
                finally:
                    lf.liveness.release()
        finally:
            lf.let_go()

    def _close_locked(self) -> None:
        lf = self.log
        fd = lf.open_for_close()
        if fd is None:
            return
        try:
            lock(fd, LOCK_EX, lf.path, lf.lock_wait_s)
            try:
                st = os.fstat(fd)
            except OSError as exc:
                raise os_error(exc, lf.path, "closing: checking (fstat)") from exc
            if (st.st_dev, st.st_ino) != lf.identity:
                log.warning(
                    "%s is no longer the file this FileStore joined (removed and created "
                    "again): not counting this close in it", lf.path,
                )
                return
            lf.catch_up(fd)
            finished = lf.add_in_cycle(fd, _CLEANUP, 1, "cleanup/")
            refcount = lf.add_in_cycle(fd, _REFCOUNT, -1, "refcount/")
            remove = refcount == 0 and lf.world_size >= 0 and finished >= lf.world_size
            lf.liveness.count_out(remove)  # the side file goes first (Liveness.count_out)
            if remove:
                unlink(lf.path)
                log.debug("last user closed %s (world size %d): removed", lf.path, lf.world_size)
            else:
                log.debug("closed %s (refcount %d, cleanup %d)", lf.path, refcount, finished)
            lf.liveness.release()
        finally:
            unlock_close(fd)
