"""The store server's own cost per request, without sockets or a client: a plain ADD against a
numbered one (its sequence header, then the ADD: what a reconnecting distlib client sends),
fed to the request engine one request at a time, as a lone client's requests arrive:
``python -m distlib_bench.store_engine --requests 200000 --rounds 5``.

Why a bench of its own: a client's round trip is mostly the kernel's and the client's, so the
engine's share of what numbering costs is lost in the noise of ``distlib bench store``; here
it is the whole figure. Each round runs both, one after the other; medians of the rounds.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from typing import List, Tuple

from distlib.store.tcp import codec
from distlib.store.tcp.budget import ClientLimits
from distlib.store.tcp.codec import Limits
from distlib.store.tcp.connection import Connection
from distlib.store.tcp.engine import RequestEngine
from distlib.store.tcp.sequence import sequence_header


def per_request_us(numbered: bool, requests: int) -> float:
    """Microseconds per ADD on one key, fed one request per ``feed`` as a lone client's come."""
    engine = RequestEngine(Limits(), ClientLimits(), 1 << 30, lambda conn, n: None)
    mine, _theirs = socket.socketpair()  # (a connection needs a socket; nothing is sent on it)
    try:
        conn = Connection(mine, "bench")
        session = os.urandom(16)
        add = codec.add(b"/counter", 1)
        frames = [sequence_header(session, i + 1) + add if numbered else add for i in range(requests)]
        feed, out, answered = engine.feed, conn.out, engine.answered
        started = time.perf_counter()
        for frame in frames:
            feed(conn, frame)
            out.clear()
            answered.clear()
        took = time.perf_counter() - started
    finally:
        mine.close()
        _theirs.close()
    if engine.state.add(b"/counter", 0) != requests:
        raise RuntimeError(f"the engine counted {engine.state.add(b'/counter', 0)} of {requests} ADDs")
    return took / requests * 1e6


def measure(requests: int, rounds: int) -> Tuple[List[float], List[float]]:
    plain, numbered = [], []
    for _ in range(rounds):
        plain.append(per_request_us(False, requests))
        numbered.append(per_request_us(True, requests))
    return plain, numbered


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m distlib_bench.store_engine", description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=200000, help="ADDs per run (default 200000)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of both runs (default 5)")
    args = parser.parse_args(argv)
    if args.requests < 1 or args.rounds < 1:
        parser.error("--requests and --rounds are 1 or more")
    plain, numbered = measure(args.requests, args.rounds)
    p, n = statistics.median(plain), statistics.median(numbered)
    print(f"engine cost per ADD, median of {args.rounds} rounds of {args.requests}:")
    print(f"  plain     {p:6.2f} us   (rounds: {', '.join(f'{x:.2f}' for x in plain)})")
    print(f"  numbered  {n:6.2f} us   (rounds: {', '.join(f'{x:.2f}' for x in numbered)})")
    print(f"  numbering costs {n - p:.2f} us per write ({n / p:.2f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
