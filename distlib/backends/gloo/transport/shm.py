"""Shared-memory segments for ranks on one host.

A segment is a file in /dev/shm, mapped by every local rank. Rank 0 of the local group
creates it with ``posix_fallocate`` (so a full /dev/shm — Docker gives containers 64 MiB by
default — is an error now, not a SIGBUS later), the others map it, and once all have mapped
it rank 0 unlinks the name: the memory lives exactly as long as the mappings, so a crashed
job leaves nothing behind in /dev/shm. ``close()`` unmaps (destroy_process_group).

multiprocessing.shared_memory is not used: its resource tracker unlinks segments when any
attaching process exits, which breaks a segment that outlives one rank's interpreter.
"""

from __future__ import annotations

import mmap
import os
import secrets
from typing import Optional

from ....errors import DistBackendError

SHM_DIR = "/dev/shm"


def free_bytes(directory: str = SHM_DIR) -> int:
    try:
        stat = os.statvfs(directory)
    except OSError:
        return 0
    return stat.f_bavail * stat.f_frsize


class SharedSegment:
    """A mapped segment of ``size`` bytes, named ``name`` under /dev/shm."""

    def __init__(self, name: str, size: int, mm: mmap.mmap, owner: bool):
        self.name = name
        self.size = size
        self.mm: Optional[mmap.mmap] = mm
        self.owner = owner
        self.path = os.path.join(SHM_DIR, name)

    @classmethod
    def create(cls, size: int, prefix: str = "distlib") -> "SharedSegment":
        name = f"{prefix}-{os.getpid()}-{secrets.token_hex(6)}"
        path = os.path.join(SHM_DIR, name)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                os.unlink(path)
                raise DistBackendError(
                    f"cannot reserve {size >> 20} MiB in {SHM_DIR} ({exc.strerror}; {free_bytes() >> 20} MiB "
                    f"free): give the container more shared memory (docker --shm-size, a Kubernetes "
                    f"emptyDir with medium Memory) or set DISTLIB_SHM=0") from None
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        return cls(name, size, mm, owner=True)

    @classmethod
    def attach(cls, name: str, size: int) -> "SharedSegment":
        path = os.path.join(SHM_DIR, name)
        fd = os.open(path, os.O_RDWR)
        try:
            if os.fstat(fd).st_size < size:
                raise DistBackendError(f"shared memory segment {path} is smaller than {size} bytes")
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        return cls(name, size, mm, owner=False)

    def unlink(self) -> None:
        """Remove the name (the mappings stay valid)."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        if self.owner:
            self.unlink()
        if self.mm is not None:
            try:
                self.mm.close()
            except BufferError:
                pass  # a view is still alive; the mapping goes with the last reference
            self.mm = None
