"""The SSH daemon of a MODE=mpi worker container: what the launcher's ``mpirun`` logs in to.

    python -m distlib_deploy.jobs.mpi_sshd

The model is Kubeflow's MPI Operator: worker containers run only ``sshd``; a launcher
container runs ``mpirun``, which starts Open MPI's daemon (``prted``) in every worker over SSH,
and the daemons start the ranks. This module makes the worker side and then ``exec``s sshd:

* **as the image's user** (uid 1000, ``distlib``), not root: sshd runs unprivileged on port
  2222 (no privileged port, no privilege separation, no PAM), and the only account it can log
  in is its own — the one the ranks run as anyway. Nothing in the container needs root;
* **a host key of its own**, made now (ed25519): the image holds none, so no two containers
  (nor two runs) share one;
* **the run's authorized key**: ``distlib cluster up`` makes a key pair per run on the host and
  mounts the public half read-only at ``AUTHORIZED_KEYS_MOUNT``; it is copied into this
  container's sshd directory, so sshd's ownership and mode checks (StrictModes) hold whoever
  owns the file on the host;
* password, keyboard-interactive and host-based logins off; no forwarding of any kind.

sshd writes its log to stderr (``-e``): the container's log shows each login. The lines of
connections that close before they try to log in — the launcher's ``ssh-keyscan``, which is
its readiness probe and fetches the host key, about 30 lines a run — are DEBUG lines:
``log_filter`` drops them unless ``DISTLIB_LOG_LEVEL`` is DEBUG. A connection closed while
logging in (``by authenticating user``, ``invalid user``) is kept.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import BinaryIO, List, Optional

from distlib import settings

from distlib.command import ToolError, run

PREFIX = "mpi_sshd:"
#: The port the workers' sshd listens on (unprivileged: sshd runs as the image's user).
SSH_PORT = 2222
#: Where `distlib cluster up` mounts the run's public key (workers) and private key (launcher).
KEY_MOUNT_DIR = "/etc/distlib/ssh"
AUTHORIZED_KEYS_MOUNT = f"{KEY_MOUNT_DIR}/authorized_keys"
PRIVATE_KEY_MOUNT = f"{KEY_MOUNT_DIR}/id_ed25519"
SSHD = "/usr/sbin/sshd"
#: The image's environment, for the commands mpirun runs over SSH (sshd starts them with a
#: minimal PATH); `mpirun --prefix` adds the venv's bin/ and lib/ as well.
REMOTE_PATH = "/opt/distlib/bin:/usr/local/bin:/usr/bin:/bin"


#: sshd's line for a connection that closed before it tried to log in: a probe (ssh-keyscan).
PROBE_LINE = re.compile(rb"^Connection (closed|reset) by [0-9A-Fa-f.:]+ port \d+ \[preauth\]\s*$")


def log(text: str) -> None:
    sys.stderr.write(f"{PREFIX} {text}\n")
    sys.stderr.flush()


def sshd_config(directory: Path, user: str, port: int = SSH_PORT) -> str:
    """The sshd_config of an unprivileged daemon that admits ``user`` with the run's key only."""
    return "\n".join([
        f"Port {port}",
        f"HostKey {directory}/host_ed25519_key",
        f"PidFile {directory}/sshd.pid",
        f"AuthorizedKeysFile {directory}/authorized_keys",
        f"AllowUsers {user}",
        "PubkeyAuthentication yes",
        "PasswordAuthentication no",
        "KbdInteractiveAuthentication no",
        "HostbasedAuthentication no",
        "PermitRootLogin no",
        "UsePAM no",
        "StrictModes yes",
        "AllowTcpForwarding no",
        "AllowAgentForwarding no",
        "AllowStreamLocalForwarding no",
        "X11Forwarding no",
        "PermitTunnel no",
        "PermitUserEnvironment no",
        "PrintMotd no",
        f"SetEnv PATH={REMOTE_PATH}",
        "LogLevel INFO",
        "",
    ])


def private_directory(directory: Path, mounted: Path, what: str) -> None:
    """Check that the run's ``what`` is mounted at ``mounted`` (ToolError saying so when not),
    and make ``directory``, mode 700, for this side's SSH files."""
    if not mounted.is_file():
        raise ToolError(f"the run's {what} is not mounted at {mounted} (distlib cluster up mounts it in MODE=mpi; "
                        "compose/mode-mpi.yml)")
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    directory.chmod(0o700)


def prepare(directory: Path, authorized_keys: Path, user: str) -> Path:
    """Make ``directory`` (mode 700) with a new host key, the authorized key and sshd_config;
    returns the config's path. ToolError, saying what is missing, when the key is not mounted
    or ssh-keygen fails."""
    private_directory(directory, authorized_keys, "public key")
    key = directory / "host_ed25519_key"
    for stale in (key, key.with_suffix(".pub")):
        stale.unlink(missing_ok=True)
    done = subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"{user}@{os.uname().nodename}",
                           "-f", str(key)], stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        raise ToolError(f"ssh-keygen could not make this worker's host key: {done.stderr.strip() or done.returncode}")
    target = directory / "authorized_keys"
    target.unlink(missing_ok=True)
    shutil.copyfile(authorized_keys, target)
    target.chmod(0o600)
    config = directory / "sshd_config"
    config.write_text(sshd_config(directory, user))
    config.chmod(0o600)
    return config


def shows_probes(level_name: str) -> bool:
    """Whether the user's log level (DISTLIB_LOG_LEVEL) shows the probes' lines (DEBUG lines)."""
    level = logging.getLevelName(level_name.strip().upper())
    return isinstance(level, int) and level <= logging.DEBUG


def log_filter(source: BinaryIO, sink: BinaryIO) -> int:
    """Copy sshd's log from ``source`` to ``sink`` line by line, without the probes' lines
    (``PROBE_LINE``); returns how many it dropped. Ends when ``source`` does (sshd exited)."""
    dropped = 0
    for line in source:
        if PROBE_LINE.match(line):
            dropped += 1
            continue
        sink.write(line)
        sink.flush()
    return dropped


def filter_stderr() -> None:
    """From here on this process's stderr (and so sshd's, after the exec) goes through
    ``log_filter``, in a forked child that writes to the real stderr and ends with sshd."""
    read_end, write_end = os.pipe()
    if os.fork() == 0:  # the filter
        os.close(write_end)
        try:
            with os.fdopen(read_end, "rb") as source, os.fdopen(os.dup(2), "wb") as sink:
                log_filter(source, sink)
        finally:
            os._exit(0)
    os.close(read_end)
    os.dup2(write_end, 2)
    os.close(write_end)


def command(config: Path) -> List[str]:
    """sshd in the foreground (-D), logging to stderr (-e)."""
    return [SSHD, "-D", "-e", "-f", str(config)]


def main(argv: Optional[List[str]] = None) -> int:
    del argv  # no options: everything comes from the image and the mounts

    def start() -> int:
        if not os.access(SSHD, os.X_OK):
            raise ToolError(f"{SSHD} is missing: this image has no SSH server (docker/build-image.sh installs "
                            "openssh-server)")
        user = user_name()
        home = Path(os.path.expanduser("~"))
        config = prepare(home / ".sshd", Path(AUTHORIZED_KEYS_MOUNT), user)
        argv = command(config)
        check = subprocess.run([*argv[:1], "-t", "-f", str(config)], capture_output=True, text=True, timeout=30)
        if check.returncode != 0:
            raise ToolError(f"sshd rejects its configuration {config}: {check.stderr.strip()}")
        log(f"sshd for user {user} on port {SSH_PORT} (host key {config.parent}/host_ed25519_key.pub: "
            f"{(config.parent / 'host_ed25519_key.pub').read_text().split()[1][:24]}...)")
        if not shows_probes(settings.log_level()):
            filter_stderr()
        os.execv(argv[0], argv)
        return 127  # not reached

    return run("mpi_sshd", start)


def user_name() -> str:
    """This process's user name (the image's user: distlib), from the password database."""
    import pwd

    return pwd.getpwuid(os.getuid()).pw_name


if __name__ == "__main__":
    sys.exit(main())
