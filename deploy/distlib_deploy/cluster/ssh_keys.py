"""The SSH key pair of a MODE=mpi run, made on the host for that run only.

The launcher's mpirun logs in to the workers with it (compose/mode-mpi.yml mounts the private
key read-only into the launcher, the public one as ``authorized_keys`` into the workers). A new
pair per run means a key never outlives its cluster: ``distlib cluster down`` deletes it with
the containers it opened.

Made with the host's ``ssh-keygen`` when there is one, else with the image's (a throwaway
container without a network, whose output is the key). Files: the directory is mode 700, so
no other user of the host can reach the key; the files in it are 644, because the containers
read them as uid 1000, whoever owns them on the host (the launcher copies the private key to
a file of its own with mode 600 before ssh uses it).
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Tuple

from distlib.command import ToolError

PRIVATE = "id_ed25519"
AUTHORIZED = "authorized_keys"
KEYGEN_TIMEOUT_S = 60


@dataclass(frozen=True)
class KeyPair:
    directory: Path
    private: Path
    authorized_keys: Path


def _with_host_keygen(comment: str) -> Optional[Tuple[bytes, str]]:
    """(private key in OpenSSH's format, public key line) from the host's ssh-keygen; None when
    the host has none."""
    keygen = shutil.which("ssh-keygen")
    if keygen is None:
        return None
    with tempfile.TemporaryDirectory(prefix="distlib-ssh-") as tmp:
        key = Path(tmp) / "key"
        done = subprocess.run([keygen, "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(key)],
                              capture_output=True, text=True, timeout=KEYGEN_TIMEOUT_S, stdin=subprocess.DEVNULL)
        if done.returncode != 0:
            raise ToolError(f"ssh-keygen could not make the run's key pair: {done.stderr.strip() or done.returncode}")
        return key.read_bytes(), Path(f"{key}.pub").read_text().strip()


#: Between the private and the public key in the output of the image's ssh-keygen.
_SEPARATOR = b"--- distlib public key ---\n"


def _with_image_keygen(client, image: str, comment: str) -> Tuple[bytes, str]:
    """The same from ssh-keygen in a throwaway container of ``image`` (no network)."""
    import docker

    script = (f"ssh-keygen -q -t ed25519 -N '' -C '{comment}' -f /tmp/key >/dev/null && cat /tmp/key && "
              f"printf '%s' '{_SEPARATOR.decode()}' && cat /tmp/key.pub")
    try:
        out = client.containers.run(image, ["sh", "-c", script], remove=True, network_mode="none",
                                    labels={"org.distlib.cluster": "1"})
    except docker.errors.DockerException as exc:
        raise ToolError(f"no ssh-keygen on this host, and running it in {image} failed: {exc}") from None
    private, _, public = bytes(out).partition(_SEPARATOR)
    if not private.startswith(b"-----BEGIN OPENSSH PRIVATE KEY-----") or not public.startswith(b"ssh-ed25519 "):
        raise ToolError(f"ssh-keygen in {image} gave no key pair: {bytes(out)[:200]!r}")
    return private, public.decode().strip()


def make(directory: Path, comment: str, client=None, image: Optional[str] = None) -> KeyPair:
    """A new ed25519 key pair in ``directory`` (replacing any there): the private key, and
    ``authorized_keys`` holding its public half."""
    made = _with_host_keygen(comment)
    if made is None:
        if client is None or not image:
            raise ToolError("no ssh-keygen on this host (install openssh-client) to make the run's key pair")
        made = _with_image_keygen(client, image, comment)
    private_bytes, public = made
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    directory.chmod(0o700)
    private = directory / PRIVATE
    authorized = directory / AUTHORIZED
    for path, data in ((private, private_bytes), (authorized, (public + "\n").encode())):
        path.unlink(missing_ok=True)
        path.write_bytes(data)
        path.chmod(0o644)
    return KeyPair(directory, private, authorized)


def remove(directory: Path) -> None:
    """Delete a run's keys (its containers are gone: nothing accepts them any more)."""
    shutil.rmtree(directory, ignore_errors=True)
