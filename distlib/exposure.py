"""Warnings where a deployment is open to others, each once per process, each naming what to do.

Why: without a token a store or mesh listener is torch's model (anyone who reaches it is the
job), and a token file or a FileStore path that other users control hands them the job. None
of these is an error (torch runs so, and a single-user host is safe), but an operator who
exposes one by accident should read it in the first lines of the log, not find out later.
Checked here:

* ``warn_open_listener``: a store or mesh listener on an address other hosts can reach
  (not loopback) with no token. Called by the store server (``distlib store-server``, rank 0's
  store of ``init_process_group``, ``distlib-run``'s), the gloo mesh and the launcher.
* ``check_token_file``: a token file that group or others can read or write, or that another
  user owns (the rule of PostgreSQL's key files: a file owned by root may be readable by its
  group, as Kubernetes mounts a Secret with ``fsGroup``). With
  ``DISTLIB_AUTH_TOKEN_FILE_STRICT=1`` it is refused instead.
* ``check_store_path``: a FileStore file or directory that another user owns and every user
  may write to; and in a directory every user may write to (``/tmp``), the store file is opened
  without following a symbolic link (``O_NOFOLLOW``), so a link planted there is refused, as
  Linux's ``fs.protected_symlinks`` would refuse it (a host may have it off).

Every warning goes to the ``distlib.exposure`` logger once per process for each listener kind,
file or path.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import stat
from typing import Optional, Set

log = logging.getLogger("distlib.exposure")

_warned: Set[str] = set()

#: What every open-listener warning tells the operator to do.
TOKEN_ADVICE = ("set DISTLIB_AUTH_TOKEN_FILE (a file holding `openssl rand -hex 32`, readable by this user only) "
                "in every process of the job (docs/security.md)")


def _once(key: str, message: str, *args) -> bool:
    """Log ``message`` at WARNING unless ``key`` was logged before in this process."""
    if key in _warned:
        return False
    _warned.add(key)
    log.warning(message, *args)
    return True


def is_loopback(host: str) -> bool:
    """Whether a bound address reaches this host only (127.0.0.0/8, ::1, ::ffff:127.x)."""
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


def warn_open_listener(what: str, sock, token: Optional[bytes]) -> bool:
    """Warn (once per process for ``what``) when ``sock``, a listening TCP socket, is bound to
    an address other hosts can reach and there is no ``token``. Returns whether it warned."""
    if token or sock is None:
        return False
    try:
        host, port = sock.getsockname()[:2]
    except (OSError, ValueError):
        return False
    if not isinstance(host, str) or is_loopback(host):
        return False
    where = f"port {port} of every interface" if host in ("0.0.0.0", "::") else \
        (f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
    return _once(f"listener:{what}", "%s listens on %s without a token: anyone who reaches %s can join and send "
                 "objects that are unpickled: %s", what, where, where, TOKEN_ADVICE)


def warn_open_job(master_addr: str, master_port: int, has_token: bool, multi_node: bool,
                  store: Optional[str] = None, consequence: str = "") -> bool:
    """The launcher's warning: a job whose store and ranks other hosts reach (several nodes,
    or a master address that is not loopback), started without a token. ``store``: words for a
    store that is not at master_addr:master_port (a file); ``consequence``: what else the
    store's openness costs this job, appended to the warning."""
    if has_token or (not multi_node and (master_addr in ("localhost", "") or is_loopback(master_addr))):
        return False
    where = store or (f"[{master_addr}]:{master_port}" if ":" in master_addr else f"{master_addr}:{master_port}")
    return _once("job", "this job's store (%s) and its ranks' listeners run without a token: anyone who reaches "
                 "them can join and send objects that are unpickled%s: %s", where, consequence, TOKEN_ADVICE)


# -- files ---------------------------------------------------------------------------------------


def _owner(uid: int) -> str:
    try:
        import pwd

        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def token_file_problem(st: os.stat_result, euid: Optional[int] = None) -> Optional[str]:
    """What is wrong with a token file of status ``st`` for this process's user, or None.

    Owned by this user: no access for group or others. Owned by root (another user's secret
    mounted for this one, as Kubernetes does): read by the group at most. Owned by anyone
    else: that user can change the token."""
    euid = os.geteuid() if euid is None else euid
    mode = stat.S_IMODE(st.st_mode)
    if st.st_uid == euid:
        if mode & 0o077:
            return (f"it is {'readable' if mode & 0o044 else 'writable'} by "
                    f"{'others' if mode & 0o007 else 'its group'} (mode {mode:04o}): chmod 600 it")
        return None
    if st.st_uid == 0:
        if mode & 0o027:
            how = "readable or writable by others" if mode & 0o007 else "writable by its group"
            return f"it is owned by root and {how} (mode {mode:04o}): make it 0440 or 0400"
        return None
    return (f"it is owned by {_owner(st.st_uid)}, not by this process's user ({_owner(euid)}): that user can "
            f"change or read the token; give the file to this user (chown) with mode 600")


def check_token_file(fd: int, path: str, source: str, strict: bool) -> None:
    """Warn (once per path) about a token file others can read or change; ValueError instead
    when ``strict`` (DISTLIB_AUTH_TOKEN_FILE_STRICT=1). ``fd`` is the file, open."""
    problem = token_file_problem(os.fstat(fd))
    if problem is None:
        return
    if strict:
        raise ValueError(f"{source}={path}: refused the token file: {problem} "
                         f"(DISTLIB_AUTH_TOKEN_FILE_STRICT=1 refuses such files; unset it to only warn)")
    _once(f"token:{path}", "%s=%s: %s; whoever can read the token can join the job, whoever can change it can "
          "lock the job out (set DISTLIB_AUTH_TOKEN_FILE_STRICT=1 to refuse such files)", source, path, problem)


def check_store_path(path: str) -> int:
    """Warn (once per path) about a FileStore ``path`` that other users control; return the
    flags (``O_NOFOLLOW`` or 0) its every open must add: no symbolic link is followed in a
    directory every user may write to."""
    directory = os.path.dirname(path) or "."
    try:
        dir_st = os.stat(directory)
    except OSError:
        return 0  # a missing directory is the store's own error, said with its path
    euid = os.geteuid()
    world_writable = bool(dir_st.st_mode & stat.S_IWOTH)
    if world_writable and dir_st.st_uid != euid:
        _once(f"store-dir:{directory}", "FileStore %s: its directory %s is owned by %s and every user may write to it "
              "(mode %04o): another user can create the store file first, as a file of theirs or a link, and "
              "write the job's records; use a directory only the job's users can write (mktemp -d, or a shared "
              "directory with mode 0770)", path, directory, _owner(dir_st.st_uid), stat.S_IMODE(dir_st.st_mode))
    try:
        st = os.stat(path)
    except OSError:
        st = None
    if st is not None and st.st_uid != euid and st.st_mode & stat.S_IWOTH:
        _once(f"store-file:{path}", "FileStore %s: the store file is owned by %s and every user may write to it "
              "(mode %04o): anyone on this host can add or change the job's records (the addresses ranks connect "
              "to); remove it and let the job create its own", path, _owner(st.st_uid), stat.S_IMODE(st.st_mode))
    return getattr(os, "O_NOFOLLOW", 0) if world_writable else 0


def symlink_refusal(path: str) -> str:
    """The error text for a store file that is a link in a directory every user may write to."""
    directory = os.path.dirname(path) or "."
    return (f"FileStore: {path} is a symbolic link in {directory}, a directory every user may write to: it is not "
            f"followed (another user can plant one there to make this job write to a file of their choosing). Use "
            f"a path in a directory only the job's users can write, or the link's target itself")
