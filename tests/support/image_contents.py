"""What the distlib images must hold, read from the working tree: where the venv is, the
distribution's name and version, and the digest of every library source file the wheel carries.
The image lanes (the CPU image's and the CUDA image's tests) compare an image with them."""

from __future__ import annotations

import hashlib
import re
import subprocess

from tests.fixtures.docker import REPO_ROOT

VENV = "/opt/distlib"
DIST_NAME = "distlib-c10d"


def repo_version(package: str = ".") -> str:
    """[project] version of the pyproject.toml in ``package`` (".": the library's; "deploy": the
    deployment's, which the images carry too) (a regex: Python 3.10 has no tomllib)."""
    return re.search(r'^version = "([^"]+)"', (REPO_ROOT / package / "pyproject.toml").read_text(), re.M).group(1)


def working_tree_sources() -> dict[str, str]:
    """sha256 of every .py file of the distlib package in the working tree (tracked, or untracked
    and not ignored: what build-image.sh puts in the wheel), keyed by path below distlib/."""
    try:
        out = subprocess.run(
            ["git", "-C", str(REPO_ROOT), "ls-files", "-z", "--cached", "--others", "--exclude-standard", "--", "distlib"],
            check=True, capture_output=True,
        ).stdout.decode()
        paths = [p for p in out.split("\0") if p]
    except (OSError, subprocess.CalledProcessError):
        paths = [str(p.relative_to(REPO_ROOT)) for p in (REPO_ROOT / "distlib").rglob("*.py")]
    result = {}
    for rel in paths:
        path = REPO_ROOT / rel
        if rel.endswith(".py") and path.is_file():
            result[rel[len("distlib/"):]] = hashlib.sha256(path.read_bytes()).hexdigest()
    return result
