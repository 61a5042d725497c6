"""The shared token of a cluster run (AUTH=1, the default), made on the host for that run only.

Why: without a token anyone who reaches the cluster network can write the store's join records
or a rank's listener and run code in every rank (docs/security.md). A new random token per run
means a token never outlives its cluster: ``distlib cluster down`` deletes it with the
containers that held it.

The token is a file, never a value: the Compose files bind-mount it read-only at
``CONTAINER_PATH`` and set ``DISTLIB_AUTH_TOKEN_FILE`` to that path, so the token itself is in
no environment, Compose file, run record or log. The directory is mode 700 (no other user of
the host reaches it); the file is mode 600 and belongs to the image's user (uid 1000), who
must read it in the containers. A host user that is neither root nor uid 1000 cannot give the
file away: it is then mode 644 inside the 700 directory, as the MODE=mpi key pair is (ssh_keys).
"""

from __future__ import annotations

import os
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path

from distlib.command import ToolError

TOKEN_FILE = "token"
#: Where every container of the run finds the token (DISTLIB_AUTH_TOKEN_FILE).
CONTAINER_PATH = "/run/secrets/distlib/token"
#: The image's user (docker/Dockerfile), who reads the token in the containers.
IMAGE_UID = 1000


@dataclass(frozen=True)
class Token:
    path: Path
    mode: int


def make(directory: Path) -> Token:
    """A new random token (64 hex digits) in ``directory``/token, replacing any there."""
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        directory.chmod(0o700)
        path = directory / TOKEN_FILE
        path.unlink(missing_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(secrets.token_hex(32) + "\n")
        mode = 0o600
        if os.getuid() == 0:
            os.chown(path, IMAGE_UID, IMAGE_UID)
        elif os.getuid() != IMAGE_UID:
            mode = 0o644
            path.chmod(mode)
    except OSError as exc:
        raise ToolError(f"cannot write the run's token file in {directory}: {exc} (CLUSTER_STATE_DIR must be "
                        "writable; AUTH=0 runs without a token)") from None
    return Token(path, mode)


def remove(directory: Path) -> None:
    """Delete a run's token (its containers are gone: nothing holds it any more)."""
    shutil.rmtree(directory, ignore_errors=True)
