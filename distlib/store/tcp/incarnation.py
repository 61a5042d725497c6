"""Which state a distlib store server serves: its *incarnation*, 16 random bytes.

Why: a client that reconnects after its master restarted must know whether the keys it
wrote are still there. A server with a state directory comes back with them and keeps its
incarnation (the file ``incarnation`` in the directory, made when the directory's state is
new); a server without one, or with a new directory, starts empty under a new incarnation.
A reconnecting client that finds a new incarnation fails at once naming the master, instead
of waiting out its timeout for keys that are gone (reconnecting.py).

On the wire (docs/wire-protocol.md): a GET of the reserved key ``INCARNATION_KEY`` answers the
16 bytes without storing anything. A distlib client asks for it right after its handshake,
only of a distlib server (the ordered-wait capability) and only when it will reconnect; a
torch server is never asked. An older distlib server answers an empty value: no incarnation.
"""

from __future__ import annotations

import os

#: The reserved key whose GET answers the server's incarnation (a NUL first: no torch key).
INCARNATION_KEY = b"\x00distlib/incarnation/v1"
INCARNATION_BYTES = 16
FILE_NAME = "incarnation"


def new_incarnation() -> bytes:
    return os.urandom(INCARNATION_BYTES)


def describe(incarnation: bytes) -> str:
    """The short form the logs and errors show (the first 8 hex digits)."""
    return incarnation.hex()[:8] if incarnation else "none"


def directory_incarnation(directory: str, fresh: bool) -> bytes:
    """The incarnation of the state in ``directory``: a new one, written there, when its state
    is ``fresh`` (nothing to replay) or it has none yet; else the one written there."""
    path = os.path.join(directory, FILE_NAME)
    if not fresh:
        try:
            with open(path, "rb") as fh:
                found = fh.read()
            if len(found) == INCARNATION_BYTES:
                return found
        except FileNotFoundError:
            pass  # a directory written before incarnations: its state gets one now
    incarnation = new_incarnation()
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, incarnation)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, path)
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # the rename survives a machine crash too
    finally:
        os.close(dir_fd)
    return incarnation
