"""The ``distlib`` command: ``store-server``, ``run``, ``gpu-info``, and the subcommands other
packages add (``bench``, ``demo``, ``cluster``).

``store-server`` (the master service), ``run`` (the launcher) and ``gpu-info`` belong to the
library. The benchmarks (distlib-c10d-bench) and the deployment (distlib-c10d-deploy) are
packages of their own, which the library does not import: each names its subcommands in the
entry-point group ``distlib.commands`` (name = "module:function", the function taking the rest
of the command line), and this command finds them only when one is asked for. Everything a
subcommand needs is imported when it runs, so ``distlib store-server --ping`` (a container
healthcheck, run every few seconds) starts fast and does not import numpy.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Any, Dict, List, Optional

from .settings import log_level

#: The entry-point group in which other packages name their subcommands.
COMMANDS_GROUP = "distlib.commands"
#: The library's own tools: subcommand -> (module whose ``main(argv)`` runs it, one line of help).
TOOLS = {
    "gpu-info": ("distlib.gpu_info", "what the nccl backend finds here: cupy, CUDA, NCCL versions and the devices"),
}
#: Subcommands of the project's other packages, for the message when one is not installed.
ELSEWHERE = {
    "bench": ("distlib-c10d-bench", "bench/", "benchmarks (store, collectives, elastic), side by side with torch"),
    "demo": ("distlib-c10d-deploy", "deploy/", "a master service and 4 local processes that rendezvous through it"),
    "cluster": ("distlib-c10d-deploy", "deploy/", "the Compose cluster: up, down, logs, ps, report, config, kill"),
}


def _security(args: argparse.Namespace):
    """The token and TLS files: the command line's, else the environment's (docs/security.md)."""
    from . import auth, settings
    from .store.tcp.security import StoreSecurity

    cert, key, ca = settings.tls_files()
    token = auth.token_from_file(args.auth_token_file) if args.auth_token_file else auth.configured_token()
    sources = {name: f"--tls-{name}" for name in ("cert", "key", "ca") if getattr(args, f"tls_{name}")}
    return StoreSecurity(token, args.tls_cert or cert, args.tls_key or key, args.tls_ca or ca, sources)


def _store_server(args: argparse.Namespace) -> int:
    from . import command

    from .store.tcp.budget import ClientLimits

    try:
        security = _security(args)
        if not args.ping:
            _ = security.server_tls  # load the certificate now: a bad file is a start-up error
        client_limits = ClientLimits(args.max_connections, args.max_connections_per_host,
                                     args.max_wait_keys_per_client, args.max_wait_keys)
    except ValueError as exc:
        print(f"distlib store-server: {exc}", file=sys.stderr)
        return 2
    if args.ping:
        return command.run("distlib store-server", lambda: _ping(args.ping, args.timeout, security))
    command.setup_logging(args.log_level)
    from .store.tcp.codec import Limits
    from .store.tcp.server import serve

    from .store.tcp.journal import JournalError

    try:
        return serve(args.host, args.port, Limits(max_key=args.max_key_bytes, max_value=args.max_value_bytes),
                     security=security, memory_budget=args.memory_budget_mb * 1024 * 1024,
                     client_limits=client_limits, state_dir=args.state_dir, sync=args.sync,
                     compact_bytes=args.compact_mb << 20, lock_wait=args.lock_wait)
    except (JournalError, OSError) as exc:
        if args.state_dir is None and not isinstance(exc, JournalError):
            raise
        print(f"distlib store-server: {exc}", file=sys.stderr)
        return 2


def _ping(endpoint: str, timeout: float, security) -> int:
    """Exit 0 iff a store server at ``endpoint`` completes the handshake and a PING."""
    from .errors import DistError
    from .store.tcp.client import TCPStore
    from .command import ToolError, parse_endpoint

    try:
        host, port = parse_endpoint(endpoint)
    except ValueError as exc:
        raise ToolError(f"--ping: {exc}", 2) from None
    try:
        store = TCPStore(host, port, timeout=timeout, security=security)
        rtt = store.ping()
        store.close()
    except (DistError, OSError, ValueError) as exc:
        print(f"distlib store-server at {host}:{port}: not answering: {exc}", file=sys.stderr)
        return 1
    kind = "distlib" if store.ordered_waits else "torch"
    print(f"distlib store-server at {host}:{port}: ok ({kind} server, ping {rtt * 1e3:.2f} ms)")
    return 0


def installed_commands() -> Dict[str, Any]:
    """The subcommands installed packages name in COMMANDS_GROUP: name -> entry point."""
    from importlib.metadata import entry_points

    return {ep.name: ep for ep in entry_points(group=COMMANDS_GROUP)}


def _tool(name: str, rest: List[str], level: str) -> int:
    """Hand the rest of the command line to the tool (imported now, not before)."""
    from . import command

    command.setup_logging(level)
    if name in TOOLS:
        return importlib.import_module(TOOLS[name][0]).main(rest)
    found = installed_commands().get(name)
    if found is None:
        dist, folder, _ = ELSEWHERE[name]
        print(f"distlib {name}: not installed here: it is in the package {dist} (pip install {dist}, "
              f"or pip install ./{folder} from a clone of the repository)", file=sys.stderr)
        return 2
    return found.load()(rest)


def build_parser() -> argparse.ArgumentParser:
    from .store.tcp import codec
    from .store.tcp import budget
    from .store.tcp import journal
    from .store.tcp.server import MEMORY_BUDGET

    parser = argparse.ArgumentParser(prog="distlib", description=__doc__.splitlines()[0])
    parser.add_argument("--log-level", default=log_level(),
                        help="logging level (default INFO; env DISTLIB_LOG_LEVEL)")
    sub = parser.add_subparsers(dest="command", required=True)

    srv = sub.add_parser(
        "store-server",
        help="run the TCP master service (the c10d TCPStore protocol; torch clients welcome)",
        description="Serve the c10d TCPStore protocol for any number of jobs until SIGTERM. "
                    "Jobs keep apart by key prefix (distlib-run --run-id).",
    )
    srv.add_argument("--host", default="127.0.0.1",
                     help="address to listen on (default 127.0.0.1: this host only; 0.0.0.0 or :: for every "
                          "interface, as a master service for other hosts needs)")
    srv.add_argument("--port", type=int, default=29500, help="port (default 29500)")
    srv.add_argument("--max-key-bytes", type=int, default=codec.MAX_KEY_BYTES,
                     help=f"longest key accepted (default {codec.MAX_KEY_BYTES})")
    srv.add_argument("--max-value-bytes", type=int, default=codec.MAX_VALUE_BYTES,
                     help=f"largest value accepted (default {codec.MAX_VALUE_BYTES})")
    srv.add_argument("--auth-token-file", metavar="PATH",
                     help="require the token in this file from every client (default: DISTLIB_AUTH_TOKEN or "
                          "DISTLIB_AUTH_TOKEN_FILE if set); with --ping, authenticate with it")
    srv.add_argument("--tls-cert", metavar="PEM", help="serve TLS with this certificate (chain) "
                                                       "(default: DISTLIB_TLS_CERT)")
    srv.add_argument("--tls-key", metavar="PEM", help="the certificate's private key (default: DISTLIB_TLS_KEY)")
    srv.add_argument("--tls-ca", metavar="PEM", help="with --ping: verify the server with this CA "
                                                     "(default: DISTLIB_TLS_CA)")
    srv.add_argument("--memory-budget-mb", type=int, default=MEMORY_BUDGET >> 20,
                     help=f"what the server may hold for its clients (unsent replies, unfinished requests, "
                          f"the keys they wait for) "
                          f"before it closes the connections holding the most (default {MEMORY_BUDGET >> 20})")
    srv.add_argument("--max-connections", type=int, default=budget.MAX_CONNECTIONS,
                     help=f"clients served at once; more are refused (default {budget.MAX_CONNECTIONS})")
    srv.add_argument("--max-connections-per-host", type=int, default=budget.MAX_CONNECTIONS_PER_HOST,
                     help=f"clients from one address; more are refused (default {budget.MAX_CONNECTIONS_PER_HOST})")
    srv.add_argument("--max-wait-keys-per-client", type=int, default=budget.MAX_WAIT_KEYS,
                     help=f"missing keys one WAIT may wait for; a client over it is disconnected "
                          f"(default {budget.MAX_WAIT_KEYS})")
    srv.add_argument("--max-wait-keys", type=int, default=budget.MAX_WAITING_KEYS,
                     help=f"distinct keys waited for, all clients together (default {budget.MAX_WAITING_KEYS})")
    srv.add_argument("--state-dir", metavar="DIR",
                     help="keep the keys in DIR (a journal of every change, compacted in the background) and "
                          "replay them at start, before the port opens: a restarted server comes back with its "
                          "state (docs/stores.md, 'State directory'); one server per DIR")
    srv.add_argument("--sync", choices=journal.SYNC_MODES, default=journal.DEFAULT_SYNC,
                     help="with --state-dir: 'turn' writes and fdatasyncs each loop turn's changes before its "
                          "replies (group commit: a reply means the change survives a machine crash); 'none' "
                          "writes them before the replies and leaves the sync to the OS (survives the process's "
                          f"death, not the machine's) (default {journal.DEFAULT_SYNC})")
    srv.add_argument("--compact-mb", type=int, default=journal.COMPACT_BYTES >> 20,
                     help=f"with --state-dir: compact the journal into a snapshot once it passes this size and twice "
                          f"the last snapshot (default {journal.COMPACT_BYTES >> 20})")
    srv.add_argument("--lock-wait", type=float, default=30.0, metavar="SECONDS",
                     help="with --state-dir: how long to wait for another server holding DIR's lock to stop (a "
                          "replacement pod started while the old one is on its way out) before refusing to start "
                          "(default 30)")
    srv.add_argument("--ping", metavar="HOST:PORT",
                     help="health check: exit 0 iff a server answers at HOST:PORT, then exit")
    srv.add_argument("--timeout", type=float, default=5.0, help="seconds --ping waits (default 5)")
    srv.add_argument("--log-level", default=argparse.SUPPRESS, help="logging level (default INFO)")
    srv.set_defaults(func=_store_server)

    for name, (_, summary) in TOOLS.items():  # listed for --help; main() dispatches them
        sub.add_parser(name, add_help=False, help=f"{summary} (distlib {name} --help)")
    installed = installed_commands()
    for name, (dist, _, summary) in ELSEWHERE.items():
        where = "" if name in installed else f"; needs {dist}"
        sub.add_parser(name, add_help=False, help=f"{summary} (distlib {name} --help{where})")
    sub.add_parser("run", add_help=False, help="the launcher (same as distlib-run; see distlib-run --help)")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # `distlib run` and the tools get everything after their name untouched (argparse would
    # take their own --flags for the distlib command's).
    i, level = 0, log_level()
    while i < len(argv) and argv[i].startswith("-") and argv[i] not in ("-h", "--help"):
        if argv[i] == "--log-level" and i + 1 < len(argv):
            level = argv[i + 1]
            i += 2
        elif argv[i].startswith("--log-level="):
            level = argv[i].split("=", 1)[1]
            i += 1
        else:
            i += 1
    if i < len(argv) and argv[i] == "run":
        from .run import main as run_main

        return run_main(argv[i + 1:])
    if i < len(argv) and (argv[i] in TOOLS or argv[i] in ELSEWHERE):
        return _tool(argv[i], argv[i + 1:], level)
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
