"""What every tool's command line shares: the common flags, logging, endpoints, JSON output,
and how a failure becomes an exit status.

Every entry point (``distlib``, ``distlib bench store|collectives``, ``distlib demo``,
``distlib cluster``) builds its parser with these helpers and runs its body through ``run``,
so that they read alike and fail alike: a ``ToolError`` is one line on stderr (``<prog>:
<what went wrong>``) and its exit status, Ctrl-C is 130, a bad option is argparse's 2.
Nothing here imports numpy: ``distlib store-server --ping`` (a health check run every few
seconds) goes through here and must start fast.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any, Callable, Optional, Tuple

DEFAULT_PORT = 29500
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class ToolError(Exception):
    """A tool cannot go on; the message says what it waited for or what was wrong, and
    ``status`` is the exit status it ends with."""

    def __init__(self, message: str, status: int = 1):
        super().__init__(message)
        self.status = status


def setup_logging(level: str) -> None:
    """Log records at ``level`` and above to stderr, with time and logger name. A later call
    wins (a tool's own ``--log-level`` after the ``distlib`` command's)."""
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), format=LOG_FORMAT,
                        stream=sys.stderr, force=True)


def parse_endpoint(text: str, default_port: int = DEFAULT_PORT, source: str = "the command line") -> Tuple[str, int]:
    """``host:port``, ``[v6]:port``, ``host`` or ``[v6]`` → (host, port); ValueError when the
    text has no host or a port outside 0..65535. The launcher's parser (one set of rules for
    every endpoint a user types), with a default port."""
    from distlib.launcher.resolve import ResolveError
    from distlib.launcher.resolve import parse_endpoint as parse

    try:
        host, port = parse(text, source)
    except ResolveError as exc:
        raise ValueError(str(exc)) from None
    return host, default_port if port is None else port


def endpoint_arg(text: str) -> Tuple[str, int]:
    """``parse_endpoint`` as an argparse ``type``: a bad endpoint is a usage error (status 2)."""
    try:
        return parse_endpoint(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_log_level(parser: argparse.ArgumentParser, default: Optional[str] = None) -> None:
    """``--log-level``; with no default it keeps what an outer command set (the ``distlib``
    command's own ``--log-level``, or DISTLIB_LOG_LEVEL)."""
    parser.add_argument("--log-level", default=default if default is not None else argparse.SUPPRESS,
                        metavar="LEVEL", help="logging level: DEBUG, INFO, WARNING, ERROR (default INFO; "
                                              "env DISTLIB_LOG_LEVEL)")


def add_json(parser: argparse.ArgumentParser, what: str = "the results") -> None:
    """``--json PATH|-``: also write ``what`` as JSON (``-`` = stdout; the text then goes to stderr)."""
    parser.add_argument("--json", metavar="PATH|-",
                        help=f"also write {what} as JSON (- = stdout; the table then goes to stderr)")


def add_quiet(parser: argparse.ArgumentParser, what: str = "no progress lines on stderr") -> None:
    parser.add_argument("--quiet", action="store_true", help=what)


def text_stream(json_dest: Optional[str]):
    """Where a tool prints its human-readable output: stderr when its JSON goes to stdout."""
    return sys.stderr if json_dest == "-" else sys.stdout


def write_json(dest: str, obj: Any) -> None:
    """Write ``obj`` as indented JSON to the file ``dest`` (atomically), or to stdout for ``-``."""
    text = json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n"
    if dest == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    tmp = f"{dest}.tmp{os.getpid()}"
    with open(tmp, "w") as fh:
        fh.write(text)
    os.replace(tmp, dest)


def run(prog: str, body: Callable[[], int]) -> int:
    """``body()``'s exit status; a ToolError becomes one line on stderr and its status, an
    interrupt 130. Anything else is a bug and keeps its traceback."""
    try:
        return body()
    except ToolError as exc:
        print(f"{prog}: {exc}", file=sys.stderr, flush=True)
        return exc.status
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr, flush=True)
        return 130
