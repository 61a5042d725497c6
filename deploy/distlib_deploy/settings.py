"""The deployment's own ``DISTLIB_*`` variables (docs/settings.md, "The deployment").

The library's variables are read by ``distlib.settings`` and only there; these two belong to the
jobs the images run, so they live with them. Values are read when asked, with the library's one
rule for flags and text (``distlib.settings.text``).
"""

from __future__ import annotations

from typing import Mapping, Optional

from distlib.settings import text


def job_backend(env: Optional[Mapping[str, str]] = None) -> str:
    """The backend of the cluster jobs (DISTLIB_BACKEND, else gloo)."""
    return text("DISTLIB_BACKEND", "gloo", env)


def cluster_mode(env: Optional[Mapping[str, str]] = None) -> str:
    """A Compose worker's rendezvous mode (DISTLIB_CLUSTER_MODE, else tcp)."""
    return text("DISTLIB_CLUSTER_MODE", "tcp", env)
