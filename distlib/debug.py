"""``DISTLIB_DEBUG``: how much distlib logs, like torch's ``TORCH_DISTRIBUTED_DEBUG``.

``OFF`` (default): warnings and errors only (join progress, aborts, loopback warnings).
``INFO``: also each rank's join time, the addresses it advertises, shared-memory set-up.
``DETAIL``: everything, including connection set-up and retries.
Case-insensitive; ``TORCH_DISTRIBUTED_DEBUG`` is read when ``DISTLIB_DEBUG`` is unset. Logs go to
the ``distlib`` logger; when the application has not configured logging, a stderr handler that
prefixes each line with the rank is added.
"""

from __future__ import annotations

import logging
import os

LEVELS = {"OFF": logging.WARNING, "INFO": logging.INFO, "DETAIL": logging.DEBUG}


def debug_level() -> str:
    value = os.environ.get("DISTLIB_DEBUG") or os.environ.get("TORCH_DISTRIBUTED_DEBUG") or "OFF"
    level = value.strip().upper()
    if level not in LEVELS:
        raise RuntimeError(f"The value of DISTLIB_DEBUG must be one of OFF, INFO, DETAIL, but got {value!r}")
    return level


def configure(rank: int) -> None:
    """Apply the debug level to the ``distlib`` logger (once per process, at init)."""
    logger = logging.getLogger("distlib")
    logger.setLevel(LEVELS[debug_level()])
    if not logging.getLogger().handlers and not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(f"[rank{rank}] %(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)
