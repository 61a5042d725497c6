"""Every ``DISTLIB_*`` environment variable distlib reads, and the one rule for reading them.

Why one module: a reader finds every switch in one place, and every flag accepts the same
spellings. Values are read when they are needed (at init,
when a server starts), never at import, so a process that sets a variable before
``init_process_group`` is obeyed. Each function takes an optional mapping in place of
``os.environ``, so pure code (the launcher's resolver) can pass the environment it was given.

Flags: ``1``, ``true``, ``yes``, ``on`` mean yes; ``0``, ``false``, ``no``, ``off`` mean no
(any case, surrounding blanks ignored); unset or empty means the default; anything else is a
ValueError that names the variable.

The table of every variable (what it does, its default, who should ever touch it) is
docs/settings.md; tests/test_settings.py checks that it names each variable read here and that
no other module reads one.

Tuning constants (spin times, buffer sizes, pipelining pieces, heartbeat interval) are private
constants of the modules that use them, each with the sentence that justifies its value: no
user needs to turn them, and a variable nobody sets is a test nobody runs.
"""

from __future__ import annotations

import os
from typing import Mapping, Optional, Tuple

from .exposure import check_token_file

_YES = ("1", "true", "yes", "on")
_NO = ("0", "false", "no", "off")

DEBUG_LEVELS = ("OFF", "INFO", "DETAIL")


def _env(env: Optional[Mapping[str, str]]) -> Mapping[str, str]:
    return os.environ if env is None else env


def text(name: str, default: str = "", env: Optional[Mapping[str, str]] = None) -> str:
    """The variable's value without surrounding blanks, or ``default`` when unset or empty."""
    value = _env(env).get(name, "").strip()
    return value or default


def flag(name: str, default: bool, env: Optional[Mapping[str, str]] = None) -> bool:
    """The variable as a yes/no flag under the module's one rule (see the module docstring)."""
    value = _env(env).get(name, "").strip()
    if not value:
        return default
    lower = value.lower()
    if lower in _YES:
        return True
    if lower in _NO:
        return False
    raise ValueError(f"{name}={value!r} is not a yes/no flag: use 1/true/yes/on or 0/false/no/off")


# -- the library ---------------------------------------------------------------------------------


def debug_level(env: Optional[Mapping[str, str]] = None) -> str:
    """OFF, INFO or DETAIL, from DISTLIB_DEBUG, else torch's TORCH_DISTRIBUTED_DEBUG."""
    value = text("DISTLIB_DEBUG", env=env) or text("TORCH_DISTRIBUTED_DEBUG", env=env) or "OFF"
    level = value.upper()
    if level not in DEBUG_LEVELS:
        raise RuntimeError(f"The value of DISTLIB_DEBUG must be one of OFF, INFO, DETAIL, but got {value!r}")
    return level


def log_level(env: Optional[Mapping[str, str]] = None) -> str:
    """The commands' default log level (DISTLIB_LOG_LEVEL, else INFO)."""
    return text("DISTLIB_LOG_LEVEL", "INFO", env)


def run_id(env: Optional[Mapping[str, str]] = None) -> str:
    """The job's run id: TORCHELASTIC_RUN_ID (torch's launcher), else DISTLIB_RUN_ID, else ""."""
    return text("TORCHELASTIC_RUN_ID", env=env) or text("DISTLIB_RUN_ID", env=env)


def launcher_run_id(env: Optional[Mapping[str, str]] = None) -> Optional[Tuple[str, str]]:
    """(variable, value) of the run id a node's environment gives ``distlib-run``.

    The deployment's DISTLIB_RUN_ID (the Helm chart sets it) comes before TORCHELASTIC_RUN_ID
    here, the reverse of ``run_id``: a worker inherits its launcher's id under both names.
    """
    for name in ("DISTLIB_RUN_ID", "TORCHELASTIC_RUN_ID"):
        value = text(name, env=env)
        if value:
            return name, value
    return None


def store_outage_timeout(env: Optional[Mapping[str, str]] = None) -> str:
    """distlib-run's default --store-outage-timeout (DISTLIB_STORE_OUTAGE_TIMEOUT, seconds; "60"
    when unset): how long elastic agents ride out a store that stopped answering."""
    return text("DISTLIB_STORE_OUTAGE_TIMEOUT", "60", env)


def store_reconnect_timeout(env: Optional[Mapping[str, str]] = None) -> Optional[float]:
    """DISTLIB_STORE_RECONNECT_TIMEOUT (seconds): how long a distlib TCPStore client of a distlib
    server reconnects after its connection dropped, where the code does not pass
    ``reconnect_timeout``; None (unset) means the store timeout, 0 fails at once as torch's
    client does. A process-wide knob for code that cannot reach the client, such as the store
    ``init_process_group`` makes."""
    value = text("DISTLIB_STORE_RECONNECT_TIMEOUT", "", env)
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0:
        raise ValueError(f"DISTLIB_STORE_RECONNECT_TIMEOUT={value!r}: expected seconds (a number >= 0; 0 turns "
                         "reconnecting off)")
    return seconds


def external_store(env: Optional[Mapping[str, str]] = None) -> bool:
    """Whether every rank is a client of a standing store service.

    torch's own variable keeps torch's rule (exactly ``True``), so a value torch ignores is
    ignored here too; distlib's flag follows the module's rule.
    """
    if _env(env).get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return True
    return flag("DISTLIB_EXTERNAL_STORE", False, env)


def init_method(env: Optional[Mapping[str, str]] = None) -> str:
    """DISTLIB_INIT_METHOD, or "" when unset."""
    return text("DISTLIB_INIT_METHOD", env=env)


def port_range(env: Optional[Mapping[str, str]] = None) -> Optional[Tuple[int, int]]:
    """DISTLIB_PORT_RANGE as (low, high), or None when unset."""
    value = text("DISTLIB_PORT_RANGE", env=env)
    if not value:
        return None
    try:
        low, high = (int(x) for x in value.split("-", 1))
    except ValueError:
        raise ValueError(f"DISTLIB_PORT_RANGE must look like 30000-30100, got {value!r}") from None
    if not 1 <= low <= high <= 65535:
        raise ValueError(f"DISTLIB_PORT_RANGE {value!r} is not a range of ports within 1-65535")
    return low, high


def mesh_bind_all(env: Optional[Mapping[str, str]] = None) -> bool:
    """Whether a rank's mesh listener binds every interface (DISTLIB_MESH_BIND_ALL, default no:
    only the address it advertises)."""
    return flag("DISTLIB_MESH_BIND_ALL", False, env)


def shared_memory(env: Optional[Mapping[str, str]] = None) -> bool:
    """Whether ranks of one host may use shared memory (DISTLIB_SHM, default yes)."""
    return flag("DISTLIB_SHM", True, env)


def store_unix_socket(env: Optional[Mapping[str, str]] = None) -> bool:
    """Whether the store server and its clients use the same-host UNIX socket (DISTLIB_STORE_UNIX)."""
    return flag("DISTLIB_STORE_UNIX", True, env)


def token_file_strict(env: Optional[Mapping[str, str]] = None) -> bool:
    """DISTLIB_AUTH_TOKEN_FILE_STRICT: refuse a token file that group or others can read, or
    that another user owns (default: warn; exposure.py says the rule)."""
    return flag("DISTLIB_AUTH_TOKEN_FILE_STRICT", False, env)


def read_token_file(path: str, source: str, env: Optional[Mapping[str, str]] = None) -> str:
    """The contents of a token file; ValueError naming ``source``, the file and the cause.
    Its owner and mode are checked on the open file (exposure.check_token_file): a warning,
    or a ValueError under DISTLIB_AUTH_TOKEN_FILE_STRICT."""
    strict = token_file_strict(env)
    try:
        with open(path, encoding="utf-8") as f:
            check_token_file(f.fileno(), path, source, strict)
            return f.read()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ValueError(f"{source}={path}: cannot read the token file: {reason}") from None


def auth_token(env: Optional[Mapping[str, str]] = None) -> Optional[Tuple[str, str]]:
    """(source, token text) from DISTLIB_AUTH_TOKEN or the file DISTLIB_AUTH_TOKEN_FILE names,
    or None when neither is set. Both set is an error: a job must not run with two secrets."""
    value = text("DISTLIB_AUTH_TOKEN", env=env)
    path = text("DISTLIB_AUTH_TOKEN_FILE", env=env)
    if value and path:
        raise ValueError("both DISTLIB_AUTH_TOKEN and DISTLIB_AUTH_TOKEN_FILE are set: set one of them")
    if value:
        return "DISTLIB_AUTH_TOKEN", value
    if path:
        return f"DISTLIB_AUTH_TOKEN_FILE={path}", read_token_file(path, "DISTLIB_AUTH_TOKEN_FILE", env)
    return None


def token_configured(env: Optional[Mapping[str, str]] = None) -> bool:
    """Whether DISTLIB_AUTH_TOKEN or DISTLIB_AUTH_TOKEN_FILE is set (the file is not read)."""
    return bool(text("DISTLIB_AUTH_TOKEN", env=env) or text("DISTLIB_AUTH_TOKEN_FILE", env=env))


def tls_files(env: Optional[Mapping[str, str]] = None) -> Tuple[str, str, str]:
    """(certificate, key, CA) file paths for the store's TLS: DISTLIB_TLS_CERT and
    DISTLIB_TLS_KEY (a server's certificate and key), DISTLIB_TLS_CA (the CA clients verify
    the server with); "" for each one unset. docs/security.md says when each is used."""
    return (text("DISTLIB_TLS_CERT", env=env), text("DISTLIB_TLS_KEY", env=env),
            text("DISTLIB_TLS_CA", env=env))
