"""The exception classes of torch.distributed, with the same names and hierarchy.

torch 2.x raises these from its stores and backends; code that catches
``torch.distributed.DistStoreError`` reads the same against distlib::

    DistError(RuntimeError)
    ├── DistStoreError      a store operation failed or timed out
    │   └── QueueEmptyError a non-blocking queue_pop found the queue empty
    ├── DistNetworkError    a socket could not connect, or the peer closed it
    └── DistBackendError    a collective failed (peer lost, mismatched call, timeout)

They derive from RuntimeError, as torch's do, so ``except RuntimeError`` keeps working.
"""

from __future__ import annotations


class DistError(RuntimeError):
    """Base of every distributed error."""


class DistStoreError(DistError):
    """A store operation failed: a timeout waiting for keys, a malformed value, ..."""


class DistNetworkError(DistError):
    """A network failure: connect refused or timed out, name not resolved, connection lost."""


class DistBackendError(DistError):
    """A collective failed: a peer died or disconnected, or the ranks disagreed on the call."""

    #: True when only one peer's connection is gone (gloo's transport sets it: the cause, an
    #: ABORT naming the first failure, may still arrive on another connection)
    connection_lost: bool = False


class QueueEmptyError(DistStoreError):
    """``queue_pop(key, block=False)`` found the queue empty."""


__all__ = [
    "DistError",
    "DistStoreError",
    "DistNetworkError",
    "DistBackendError",
    "QueueEmptyError",
]
