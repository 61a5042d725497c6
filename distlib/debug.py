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

from .settings import debug_level

LEVELS = {"OFF": logging.WARNING, "INFO": logging.INFO, "DETAIL": logging.DEBUG}


def configure(rank: int) -> None:
    """Apply the debug level to the ``distlib`` logger (once per process, at init)."""
    logger = logging.getLogger("distlib")
    logger.setLevel(LEVELS[debug_level()])
    if not logging.getLogger().handlers and not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(f"[rank{rank}] %(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)
