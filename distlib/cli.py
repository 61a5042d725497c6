"""The ``distlib`` command: ``store-server``, ``bench``, ``run``.

Subcommands import what they need lazily, so ``distlib store-server --ping`` (a container
healthcheck, run every few seconds) starts fast and does not import numpy.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import List, Optional


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def _parse_endpoint(text: str, default_port: int = 29500):
    """``host:port``, ``[v6]:port`` or ``host`` → (host, port)."""
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
    elif text.count(":") == 1:
        host, port = text.split(":")
    else:
        host, port = text, ""
    if not host:
        raise argparse.ArgumentTypeError(f"no host in endpoint {text!r}")
    try:
        return host, int(port) if port else default_port
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad port in endpoint {text!r}") from None


def _store_server(args: argparse.Namespace) -> int:
    if args.ping:
        return _ping(args.ping, args.timeout)
    _setup_logging(args.log_level)
    from .store.tcp.protocol import Limits
    from .store.tcp.server import serve

    return serve(args.host, args.port, Limits(max_key=args.max_key_bytes, max_value=args.max_value_bytes))


def _ping(endpoint: str, timeout: float) -> int:
    """Exit 0 iff a store server at ``endpoint`` completes the handshake and a PING."""
    from .errors import DistError
    from .store.tcp.client import TCPStore

    host, port = _parse_endpoint(endpoint)
    try:
        store = TCPStore(host, port, timeout=timeout)
        rtt = store.ping()
        store.close()
    except (DistError, OSError, ValueError) as exc:
        print(f"distlib store-server at {host}:{port}: not answering: {exc}", file=sys.stderr)
        return 1
    kind = "distlib" if store.ordered_waits else "torch"
    print(f"distlib store-server at {host}:{port}: ok ({kind} server, ping {rtt * 1e3:.2f} ms)")
    return 0


def _bench(args: argparse.Namespace) -> int:
    _setup_logging(args.log_level)
    if args.what == "store":
        from .bench.store import main as bench_store

        return bench_store(args.rest)
    from .bench.collectives import main as bench_collectives

    return bench_collectives(args.rest)


def build_parser() -> argparse.ArgumentParser:
    from .store.tcp import protocol

    parser = argparse.ArgumentParser(prog="distlib", description=__doc__.splitlines()[0])
    parser.add_argument("--log-level", default=os.environ.get("DISTLIB_LOG_LEVEL", "INFO"),
                        help="logging level (default INFO; env DISTLIB_LOG_LEVEL)")
    sub = parser.add_subparsers(dest="command", required=True)

    srv = sub.add_parser(
        "store-server",
        help="run the TCP master service (the c10d TCPStore protocol; torch clients welcome)",
        description="Serve the c10d TCPStore protocol for any number of jobs until SIGTERM. "
                    "Jobs keep apart by key prefix (distlib-run --run-id).",
    )
    srv.add_argument("--host", default="0.0.0.0", help="address to listen on (default 0.0.0.0: all)")
    srv.add_argument("--port", type=int, default=29500, help="port (default 29500)")
    srv.add_argument("--max-key-bytes", type=int, default=protocol.MAX_KEY_BYTES,
                     help=f"longest key accepted (default {protocol.MAX_KEY_BYTES})")
    srv.add_argument("--max-value-bytes", type=int, default=protocol.MAX_VALUE_BYTES,
                     help=f"largest value accepted (default {protocol.MAX_VALUE_BYTES})")
    srv.add_argument("--ping", metavar="HOST:PORT",
                     help="health check: exit 0 iff a server answers at HOST:PORT, then exit")
    srv.add_argument("--timeout", type=float, default=5.0, help="seconds --ping waits (default 5)")
    srv.add_argument("--log-level", default=argparse.SUPPRESS, help="logging level (default INFO)")
    srv.set_defaults(func=_store_server)

    bench = sub.add_parser("bench", help="benchmarks (store, collectives), side by side with torch")
    bench.add_argument("--log-level", default=argparse.SUPPRESS, help="logging level (default INFO)")
    bench.add_argument("what", choices=["store", "collectives"])
    bench.add_argument("rest", nargs=argparse.REMAINDER, help="options of the benchmark (see --help after it)")
    bench.set_defaults(func=_bench)

    sub.add_parser("run", add_help=False, help="the launcher (same as distlib-run; see distlib-run --help)")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # `distlib run` hands everything after "run" to the launcher untouched (argparse would
    # take the launcher's own --flags for its own).
    i = 0
    while i < len(argv) and argv[i].startswith("-") and argv[i] not in ("-h", "--help"):
        i += 2 if argv[i] == "--log-level" else 1
    if i < len(argv) and argv[i] == "run":
        from .run import main as run_main

        return run_main(argv[i + 1:])
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
