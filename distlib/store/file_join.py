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
"""

from __future__ import annotations

import logging
import os
import stat
import time

from ..deadline import Deadline, format_duration
from ..errors import DistStoreError
from ..exposure import check_store_path
from . import file_log
from .file_io import _OPENING, _READ_MAX, _RW_FLAGS, _WR_FLAGS, LogFile
from .file_locks import LOCK_EX, describe_kind, lock, os_error, unlink, unlock_close
from .file_sidecar import SETTLE_S, StaleSuspected

log = logging.getLogger("distlib.store.file")

_REFCOUNT = file_log.REFCOUNT_KEY
_CLEANUP = file_log.CLEANUP_KEY


class JoinedFile(LogFile):
    """A ``LogFile`` with the constructor's ``join`` and the destructor's ``close``."""

    __slots__ = ()

    # -- joining: constructor --------------------------------------------------------------------

    def join(self) -> None:
        """The constructor's work: create/open the file, check it, refcount += 1.

        All under the file's LOCK_EX, so joiners and closers of every process (torch's too)
        are serialised: the stale check and the refcount see a settled file.
        """
        self.nofollow = check_store_path(self.path)  # warnings (once), O_NOFOLLOW in a world-writable directory
        try:
            self._join_once(settled=False)
        except StaleSuspected as suspected:
            log.warning(
                "FileStore %s: its side file counts %d user(s) but none holds the liveness lock: "
                "a crashed run, or live users on NFS whose locks a server restart took; looking "
                "again in %s, after live users have renewed their locks",
                self.path, suspected.users, format_duration(SETTLE_S),
            )
            time.sleep(SETTLE_S)
            self.cache.clear()  # nothing was joined: read the file afresh
            self.offset, self.tail = 0, b""
            self._join_once(settled=True)
        log.debug("joined %s (refcount now %s)", self.path, self.cache.get(_REFCOUNT))

    def _join_once(self, settled: bool) -> None:
        with self.shared.mutex:
            fd = self._open_locked_for_join()
            try:
                self._catch_up(fd)
                stale = (lambda users: self._stale_error(fd, users)) if self.offset > 0 else None
                self.liveness.join(stale, self.lock_wait_s, self.nofollow, settled)
                try:
                    self._add_locked(fd, _REFCOUNT, 1, "refcount/")
                except BaseException:
                    self.liveness.count_out(False)
                    self.liveness.release()
                    raise
            finally:
                unlock_close(fd)

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
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    raise DistStoreError(
                        f"FileStore: {self.path} is {describe_kind(st.st_mode)}, not a regular "
                        f"file: a store file must be a regular file (a device or a pipe can "
                        f"yield endless data, or none, and cannot hold records). Give the path "
                        f"of a file on a local or shared file system"
                    )
                lock(fd, LOCK_EX, self.path, self.lock_wait_s)
                try:
                    now = os.stat(self.path)
                except FileNotFoundError:
                    now = None
            except OSError as exc:
                unlock_close(fd)
                raise os_error(exc, self.path, "checking (fstat/stat)") from exc
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
        records = 0
        at = 0
        try:
            while at < self.offset:  # count in bounded reads: the file may be big
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
        except OSError as exc:
            return os_error(exc, self.path, "reading (to report a dead run's records in)")
        refcount = self.cache.get(_REFCOUNT, b"0").decode("ascii", "replace")
        cleanup = self.cache.get(_CLEANUP, b"0").decode("ascii", "replace")
        return DistStoreError(
            f"FileStore: store file {self.path} holds {records} records from an earlier run "
            f"whose processes are gone (refcount {refcount}, cleanup {cleanup}; {dead_users} distlib "
            f"user(s) never closed it: killed or crashed, or their host lost). Joining it would mix "
            f"that run's keys into this one. (If this job's own ranks wrote them, one of them died "
            f"before this rank joined: read its log.) Remove {self.path} and {self.liveness.path} "
            f"and start again."
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
            fd = os.open(self.path, _RW_FLAGS | self.nofollow)
        except FileNotFoundError:
            return
        except OSError as exc:
            raise os_error(exc, self.path, "closing: " + _OPENING[_RW_FLAGS]) from exc
        try:
            lock(fd, LOCK_EX, self.path, self.lock_wait_s)
            try:
                st = os.fstat(fd)
            except OSError as exc:
                raise os_error(exc, self.path, "closing: checking (fstat)") from exc
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
