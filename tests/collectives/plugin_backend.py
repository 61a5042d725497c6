"""A third-party backend used in the tests: all_reduce and barrier through the store.

Real, if slow: each rank publishes its array under a per-operation key and reduces everyone's
in rank order. It shows the plugin API end to end (Backend.register_backend → init_process_group
→ collectives → destroy).
"""

from datetime import timedelta

import numpy as np

from distlib import CommBackend
from distlib.reduce_op import accumulate, finish


class StoreBackend(CommBackend):
    name = "storebackend"

    def __init__(self, store, rank, size, timeout: timedelta):
        super().__init__(store, rank, size, timeout)
        self.seq = 0

    def _exchange(self, payload: bytes):
        key = f"op{self.seq}"
        self.seq += 1
        self.store.set(f"{key}/{self.rank}", payload)
        return self.store.multi_get([f"{key}/{r}" for r in range(self.size)])

    def all_reduce(self, array, op):
        values = self._exchange(array.tobytes())
        result = np.frombuffer(values[0], array.dtype).copy()
        for data in values[1:]:
            accumulate(op, result, np.frombuffer(data, array.dtype))
        finish(op, result, self.size)
        array.reshape(-1)[...] = result

    def barrier(self):
        self._exchange(b"")


def create(store, rank, size, timeout):
    return StoreBackend(store, rank, size, timeout)
