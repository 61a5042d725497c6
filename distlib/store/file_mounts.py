"""Is a FileStore's file on a file system whose ``flock`` locks every host honours?

FileStore relies on ``flock`` to keep writers of every process (and every host, on a shared
file system) from interleaving records. Some mounts keep those locks on the local host
only, and two hosts then both "hold" the lock and corrupt the file silently. This module
reads ``/proc/self/mountinfo`` (proc(5)), finds the mount that holds a path and says what is
wrong with its options; ``check_mount`` turns that into a clear error at construction.
Pure parsing plus one read of the mount table, no locks.
"""

from __future__ import annotations

import logging
import os
import re
from typing import List, NamedTuple, Optional, Sequence, Tuple

from ..errors import DistStoreError

log = logging.getLogger("distlib.store.file")


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
