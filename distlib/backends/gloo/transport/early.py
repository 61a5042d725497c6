"""``EarlyBuffers``: where a frame that arrives before its receive is posted waits, reused.

Why: in back-to-back collectives the ranks do not finish together. A left neighbour that
is done first starts the next operation and sends its first pieces (a whole ring chunk:
16 MiB at 64 MiB over 4 ranks) before this rank has posted their receives, and the mesh
must read them (or that neighbour's sends, and with them the group, could stall; see
tcp.py). A fresh buffer for each such frame costs the kernel a page fault per page and
the zeroing of every page (perf on a 64 MiB all_reduce at 4 ranks over TCP: 150 to 800
page faults per operation per rank, clear_page 6 % of all CPU); a buffer kept from the
previous operation costs only the copy into the receive once it is posted.
"""

from __future__ import annotations

import threading
from typing import Dict, List

#: Frames smaller than this get a fresh buffer (malloc serves them without page faults).
MIN_KEPT_BYTES = 256 << 10

#: At most this many bytes of early-frame buffers are kept per mesh.
KEEP_LIMIT = 64 << 20


class EarlyBuffers:
    """Buffers by exact size: ``take(n)`` a bytearray of n bytes, ``give(buf)`` it back once
    its contents are copied out. Thread-safe (the progress thread and a waiting thread both
    read frames)."""

    def __init__(self, limit: int = KEEP_LIMIT):
        self.limit = limit
        self.kept = 0
        self._free: Dict[int, List[bytearray]] = {}
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> bytearray:
        if nbytes >= MIN_KEPT_BYTES:
            with self._lock:
                free = self._free.get(nbytes)
                if free:
                    self.kept -= nbytes
                    return free.pop()
        return bytearray(nbytes)

    def give(self, buf: bytearray) -> None:
        nbytes = len(buf)
        if nbytes < MIN_KEPT_BYTES:
            return
        with self._lock:
            if self.kept + nbytes > self.limit:
                return
            self.kept += nbytes
            self._free.setdefault(nbytes, []).append(buf)

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
            self.kept = 0
