"""The file-system calls FileStore depends on, with their failure modes named.

* ``lock``: ``flock`` with a deadline. A blocking ``flock()`` cannot be given one; polling
  with ``LOCK_NB`` can, so a process stopped while holding the lock (or a stuck NFS lock)
  gives an error, not a hang. A file system that cannot lock at all is a clear error naming
  the file, the mount and the fix (``lock_error``), never a silent race.
* ``unlock_close``: the end of every operation.
* ``unlink``: best effort, as torch's destructor.
* ``os_error``: any other failing call on the file, as a DistStoreError that names the file,
  the operation, the errno and, where one helps, what to do (a read-only mount, a
  directory given as the path, a file this user may not write).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import stat
import time

from ..deadline import Deadline, format_duration
from ..errors import DistStoreError
from .file_mounts import mount_of

log = logging.getLogger("distlib.store.file")

LOCK_SH = fcntl.LOCK_SH
LOCK_EX = fcntl.LOCK_EX
_LOCK_UN = fcntl.LOCK_UN
_LOCK_NB = fcntl.LOCK_NB

#: flock() errors that mean "this file system cannot lock", not "try again".
NO_LOCKING = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS}


def lock(fd: int, op: int, path: str, wait_s: float) -> None:
    """flock(op) on ``fd`` (the file ``path``), waiting at most ``wait_s`` for a busy lock."""
    try:
        fcntl.flock(fd, op | _LOCK_NB)
        return
    except BlockingIOError:
        pass
    except OSError as exc:
        what = "LOCK_EX" if op == LOCK_EX else "LOCK_SH"
        if exc.errno in NO_LOCKING:
            raise lock_error(exc, path, what) from exc
        raise os_error(exc, path, f"locking (flock {what})") from exc
    _lock_contended(fd, op, path, wait_s)


def _lock_contended(fd: int, op: int, path: str, wait_s: float) -> None:
    """Wait for a busy lock: yield a few times, then sleep 20 µs doubling to 2 ms (locks are
    held for microseconds, so most waits end in the first yields)."""
    deadline = Deadline(wait_s)
    delay = 20e-6
    tries = 0
    while True:
        if tries < 4:
            os.sched_yield()
        else:
            left = deadline.remaining()
            if left <= 0:
                raise DistStoreError(
                    f"FileStore: could not lock store file {path} within "
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
        except OSError as exc:
            raise os_error(exc, path, "locking (flock)") from exc


def try_lock_exclusive(fd: int, path: str) -> bool:
    """``LOCK_EX | LOCK_NB`` on ``fd``: whether it was granted (no other holder)."""
    try:
        fcntl.flock(fd, LOCK_EX | _LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError as exc:
        if exc.errno in NO_LOCKING:
            raise lock_error(exc, path, "LOCK_EX") from exc
        raise os_error(exc, path, "locking (flock LOCK_EX)") from exc


def describe_kind(mode: int) -> str:
    """What a non-regular file is, for error texts ("a character device", ...)."""
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISFIFO, "a named pipe (FIFO)"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def unlock_close(fd: int) -> None:
    """Unlock, then close.

    The explicit unlock matters: a process forked meanwhile shares the open file, and
    close() alone would leave the lock held through its copy. An unlock that fails is not
    reported (close() drops the lock anyway, and on an error path it must not hide the
    first error).
    """
    try:
        fcntl.flock(fd, _LOCK_UN)
    except OSError:
        pass
    os.close(fd)


def lock_error(exc: OSError, path: str, what: str) -> DistStoreError:
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


def os_error(exc: OSError, path: str, operation: str, what: str = "store file") -> DistStoreError:
    """The error for a failed call on ``path`` (the ``what``) during ``operation``
    ("opening (for writing)", "reading", ...): the file, the operation, the errno's name and
    text, and a hint."""
    code = exc.errno or 0
    name = errno.errorcode.get(code, f"errno {code}")
    hint = _hint(code, path, operation)
    if hint:
        hint = ". " + hint[0].upper() + hint[1:]
    return DistStoreError(
        f"FileStore: {operation} {what} {path} failed with {name} ({exc.strerror or exc}){hint}"
    )


def _hint(code: int, path: str, operation: str) -> str:
    """What to do about errno ``code`` on ``path``, or "" when there is nothing to add."""
    directory = os.path.dirname(path) or "."
    if code == errno.EISDIR:
        return (
            f"{path} is a directory; FileStore needs the path of a file (for example "
            f"{os.path.join(path, 'store')}), which it creates"
        )
    if code == errno.ENOTDIR:
        return f"a component of {directory} is a file, not a directory"
    if code == errno.EROFS:
        mount = mount_of(path)
        where = f"mount {mount.mount_point} (source {mount.source})" if mount else "its file system"
        return (
            f"{where} is read-only; every FileStore user appends to the file (its refcount at "
            f"least), so put the file on a writable file system"
        )
    if code in (errno.EACCES, errno.EPERM):
        return _permission_hint(path, directory, operation)
    if code in (errno.ENOSPC, errno.EDQUOT):
        return f"the file system holding {directory} is full, or this user's quota is used up"
    if code == errno.ENXIO:
        return f"{path} is a socket or a device, not a regular file; give the path of a regular file"
    if code in (errno.ELOOP, errno.ENAMETOOLONG):
        return "check the path: a symlink loop, or a name longer than the file system allows"
    return ""


def _permission_hint(path: str, directory: str, operation: str) -> str:
    user = f"uid {os.geteuid()}"
    try:
        st = os.stat(path)
    except OSError:
        st = None
    if st is None:
        if "writing" in operation:
            return (
                f"the file does not exist and directory {directory} does not let {user} create "
                f"it; use a directory this user may write to"
            )
        return f"{user} may not reach {path} (check the permissions of {directory} and its parents)"
    mode = stat.S_IMODE(st.st_mode)
    if "writing" in operation or "append" in operation:
        return (
            f"the file (mode {mode:04o}, owner uid {st.st_uid}) is not writable by {user}; every "
            f"FileStore user appends to the file (its refcount at least), so it must be writable "
            f"by each of them"
        )
    return f"the file (mode {mode:04o}, owner uid {st.st_uid}) is not readable by {user}"


def unlink(path: str) -> None:
    """Remove ``path``; a file already gone is fine, one we cannot remove is logged, as torch."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("could not remove %s: %s", path, exc)
