"""The liveness side file ``<store file>.distlib-live``: is a store file left by a crashed run?

torch's FileStore counts its users in the store file itself (``refcount/``), so a process
killed before it closed leaves a count that never returns to 0, and the next run joins the
old file silently, mixing that run's keys into its own. distlib keeps a second file beside
the store file:

* it holds the number of distlib users that joined and have not closed yet (decimal ASCII
  and a newline), and
* every live distlib FileStore holds ``flock(LOCK_SH)`` on it, which the kernel drops when
  the process dies (SIGKILL included).

A joiner (holding the store file's ``LOCK_EX``) tries ``LOCK_EX|LOCK_NB`` on the side file:
granted means no distlib user is alive; if the count is still above 0, some user died
without closing, and if the store file holds records, they are that dead run's: an error
naming both files. A store file without a side file was created by torch (whose processes
hold no liveness lock), or its distlib users all closed cleanly (the last one removes the
side file): nothing to tell, so join. Counting users (not just testing the lock) keeps live
*torch* users of a shared file from looking like a crash.

A lock can also vanish under a live user: an NFS client that misses the server's grace
period after a restart cannot reclaim its locks, and Linux drops them without telling the
process (``nfs.recover_lost_locks=0``, the default). So a live user takes its lock afresh,
on a new descriptor, every ``RENEW_S`` while it waits on the store (``renew``), and a joiner
that finds counted users but no lock looks again after ``SETTLE_S`` (``StaleSuspected``)
before it calls the file a dead run's.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import time
from typing import Callable, Optional

from ..errors import DistStoreError
from .file_locks import LOCK_SH, lock, os_error, try_lock_exclusive, unlink

log = logging.getLogger("distlib.store.file")

#: Suffix of the liveness side file that every live distlib FileStore holds ``LOCK_SH`` on.
SIDECAR_SUFFIX = ".distlib-live"

_FILE_MODE = 0o644

#: How often a live user, while it waits on the store, takes its liveness lock afresh.
RENEW_S = 1.0
#: How long a joiner that finds counted users but no lock waits before it looks again:
#: a waiting live user renews within RENEW_S plus one poll.
SETTLE_S = 3.0 * RENEW_S


class StaleSuspected(Exception):
    """The side file counts ``users`` users, yet none holds its lock: a dead run, or live
    users whose locks an NFS server restart took. The joiner releases the store file, waits
    ``SETTLE_S`` for live users to renew, and joins again with ``settled=True``."""

    def __init__(self, users: int) -> None:
        super().__init__(users)
        self.users = users


class Liveness:
    """One FileStore's registration in the side file of its store file.

    ``shared`` is the per-process record of the store file (its ``live`` count says how many
    FileStores of this process use the file: a process that already uses it is live by
    definition and skips the stale check).
    """

    __slots__ = ("store_path", "path", "shared", "fd", "nofollow", "renewed")

    def __init__(self, store_path: str, real_path: str, shared) -> None:
        self.store_path = store_path
        self.path = real_path + SIDECAR_SUFFIX
        self.shared = shared
        self.fd: Optional[int] = None
        self.nofollow = 0
        self.renewed = 0.0  # time.monotonic() of the last renew

    def join(self, stale_error: Optional[Callable[[int], DistStoreError]], lock_wait_s: float,
             nofollow: int = 0, settled: bool = True) -> None:
        """Detect a dead run's store file, then count this user in (the caller holds the store
        file's LOCK_EX). ``stale_error(dead_users)`` builds the error when the store file
        holds records; None when it is empty (a dead count on an empty file is forgotten).
        ``nofollow``: O_NOFOLLOW in a directory every user may write to (exposure.py).
        ``settled=False``: raise ``StaleSuspected`` instead of the error (a first look)."""
        self.nofollow = nofollow
        try:
            sfd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | nofollow, _FILE_MODE)
        except OSError as exc:
            log.warning("cannot open the liveness file %s (%s): stale-file detection is off for %s",
                        self.path, exc, self.store_path)
            return
        try:
            users = _read_users(sfd, self.path)
            if self.shared.live == 0 and try_lock_exclusive(sfd, self.path):
                if users > 0 and stale_error is not None:
                    raise stale_error(users) if settled else StaleSuspected(users)
                if users > 0:
                    log.info("%s counted %d user(s) of a store file that is now empty; starting afresh",
                             self.path, users)
                users = 0
            lock(sfd, LOCK_SH, self.path, lock_wait_s)  # a downgrade when we hold LOCK_EX; nobody else can
            _write_users(sfd, users + 1, self.path)
        except BaseException:
            os.close(sfd)
            raise
        self.fd = sfd
        self.renewed = time.monotonic()
        self.shared.live += 1

    def renew(self, now: float) -> None:
        """Take the liveness lock again on a new descriptor, then let the old one go (the
        caller holds the process mutex; ``now`` is time.monotonic()). An NFS client may have
        lost the old lock in a server restart without a word; a new descriptor is a new lock
        owner, so the server grants it afresh. Busy (a joiner is checking right now) or the
        side file replaced: the old descriptor is kept and the next renew tries again."""
        old = self.fd
        self.renewed = now
        if old is None:
            return
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC | self.nofollow)
        except OSError as exc:
            log.debug("cannot reopen the liveness file %s to renew its lock: %s", self.path, exc)
            return
        try:
            mine, now_named = os.fstat(old), os.fstat(fd)
            if (mine.st_dev, mine.st_ino) != (now_named.st_dev, now_named.st_ino):
                os.close(fd)
                return
            fcntl.flock(fd, LOCK_SH | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                log.warning("cannot renew the liveness lock on %s (%s): a joiner may take this "
                            "live user of %s for a dead one", self.path, exc, self.store_path)
            return
        self.fd = fd
        try:  # the old lock may be one the server no longer has: its unlock can fail
            fcntl.flock(old, fcntl.LOCK_UN)
        except OSError:
            pass
        try:
            os.close(old)
        except OSError:
            pass

    def count_out(self, removing_store: bool) -> None:
        """Count this user out (the caller holds the store file's LOCK_EX).

        At 0 users the side file says nothing a missing one would not, so it is removed
        (before the store file, so that a joiner never pairs a new store file with an old
        side file); it therefore only outlives its users when one of them died.
        """
        if self.fd is None:
            return
        users = max(0, _read_users(self.fd, self.path) - 1)
        if users == 0 or removing_store:
            unlink(self.path)
        else:
            _write_users(self.fd, users, self.path)

    def release(self) -> None:
        """Let go of the liveness lock (after ``count_out``, or when joining failed)."""
        sfd = self.fd
        if sfd is None:
            return
        self.fd = None
        self.shared.live = max(0, self.shared.live - 1)
        try:
            fcntl.flock(sfd, fcntl.LOCK_UN)
        finally:
            os.close(sfd)

    def forget_in_fork(self) -> None:
        """A forked copy closes its descriptor without unlocking: the parent owns this user."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _read_users(sfd: int, name: str) -> int:
    try:
        raw = os.pread(sfd, 64, 0)
    except OSError as exc:
        raise os_error(exc, name, "reading", "liveness side file") from exc
    text = raw.strip()
    if not text:
        return 0
    try:
        return max(0, int(text.split()[0]))
    except ValueError:
        log.warning("liveness file %s holds %r, not a count; reading it as 0", name, raw[:32])
        return 0


def _write_users(sfd: int, users: int, name: str) -> None:
    data = b"%d\n" % users
    try:
        os.pwrite(sfd, data, 0)
        os.ftruncate(sfd, len(data))
    except OSError as exc:
        raise os_error(exc, name, "writing", "liveness side file") from exc
