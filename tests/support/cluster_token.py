"""What every run of the Compose cluster must show about its token (AUTH, on by default): who
held it, where, and where it must never appear. The cluster lanes check each real run with it."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from distlib_deploy.cluster import engine


def check_the_run_used_its_token(proc: subprocess.CompletedProcess, docker_client, state_dir: Path,
                                 project: str, mode: str) -> str:
    """AUTH (on by default): `up` said so, every container that runs distlib held the run's
    token file read-only at /run/secrets/distlib/token, and the token itself is in no output,
    log, run record or container environment. Returns the token."""
    from distlib_deploy.cluster import auth_token

    assert "cluster: auth on: made this run's token in " in proc.stderr, proc.stderr
    assert "auth on: every connection authenticated with the run's token" in proc.stderr, proc.stderr
    token_file = state_dir / project / "auth" / "token"
    token = token_file.read_text().strip()
    # 600 and the image's user's (auth_token.py: 644 in a 700 directory for a host user who
    # can give a file to no one)
    assert len(token) == 64 and token_file.stat().st_mode & 0o777 == \
        (0o600 if os.getuid() in (0, auth_token.IMAGE_UID) else 0o644)
    assert token_file.parent.stat().st_mode & 0o777 == 0o700
    assert token not in proc.stdout + proc.stderr
    for path in (state_dir / project).glob("*.log"):
        assert token not in path.read_text(errors="replace"), path
    assert token not in (state_dir / "current.json").read_text()
    services = {"tcp": {"master", "worker"}, "mpi": {"launcher", "worker"},
                "slurm": {"slurmctld", "worker"}}.get(mode, {"worker"})
    holders = set()
    for container in engine.project_containers(docker_client, project):
        attrs = container.attrs
        assert not any(token in e for e in attrs["Config"]["Env"] or []), container.name
        assert token not in engine.logs_text(container), container.name
        mounts = [m for m in attrs["Mounts"] if m["Destination"] == auth_token.CONTAINER_PATH]
        if mounts:
            assert [(m["Source"], m["RW"]) for m in mounts] == [(str(token_file), False)], mounts
            assert f"DISTLIB_AUTH_TOKEN_FILE={auth_token.CONTAINER_PATH}" in attrs["Config"]["Env"]
            holders.add(container.labels["com.docker.compose.service"])
    assert holders == services
    return token
