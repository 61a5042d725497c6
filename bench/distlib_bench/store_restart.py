"""The time from a master service's (re)start to its first served request, with N keys in its
state directory: ``python -m distlib_bench.store_restart --keys 10000,1000000``.

For each N it writes a state directory as a server would have left it (N SETs in the journal;
with ``--compacted``, a snapshot of them instead), starts ``distlib store-server --state-dir``
and times spawn -> first PING answered, and reads the server's own replay time from its log
line ('replayed N keys ... in T'). The rest of the start (the interpreter, imports) is the
difference between the two. Medians of ``--repeat`` starts.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import tempfile
import time
from typing import List, Optional

from distlib.store.tcp import journal_records as records
from distlib.store.tcp.journal import Journal
from distlib.store_service import StoreServerProcess

VALUE = b"v" * 32
BATCH = 10000


def fill(directory: str, keys: int, compacted: bool) -> int:
    """A state directory holding ``keys`` keys; its size in bytes."""
    journal = Journal(directory, "none", compact_bytes=1 << 62)
    journal.recover()
    for start in range(0, keys, BATCH):
        journal.pending.extend(records.frame(records.set_record(b"/key/%d" % i, VALUE))
                               for i in range(start, min(keys, start + BATCH)))
        journal.commit()
    if compacted:
        image = records.Image()
        image.data = {b"/key/%d" % i: VALUE for i in range(keys)}
        journal.copy_state = lambda: image
        journal.compact()
        journal.wait_compaction(600)
    journal.close()
    return sum(os.path.getsize(os.path.join(directory, n)) for n in os.listdir(directory))


def one_start(directory: str, log_path: str) -> tuple:
    """(seconds from spawn to the first PING answered, the server's replay time in seconds)."""
    if os.path.exists(log_path):
        os.unlink(log_path)
    server = StoreServerProcess("127.0.0.1", args=["--state-dir", directory], log_level="INFO", log_path=log_path)
    started = time.monotonic()
    server.start(600)
    served = time.monotonic() - started
    server.stop()
    m = re.search(r"replayed (\d+) keys .* in ([\d.]+)(ms|s)\b", server.log_text())
    replay = float(m.group(2)) / (1000 if m.group(3) == "ms" else 1) if m else float("nan")
    return served, replay


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--keys", default="10000,1000000", help="key counts, comma-separated")
    p.add_argument("--repeat", type=int, default=3, help="starts per key count (median)")
    p.add_argument("--compacted", action="store_true", help="the keys in a snapshot, not a journal")
    args = p.parse_args(argv)
    print(f"{'keys':>9}  {'state':>9}  {'DIR bytes':>11}  {'replay (log)':>12}  {'spawn -> first request':>22}")
    for keys in (int(k) for k in args.keys.split(",")):
        directory = tempfile.mkdtemp(prefix="distlib-restart-")
        try:
            size = fill(directory, keys, args.compacted)
            runs = [one_start(directory, os.path.join(directory, "..", os.path.basename(directory) + ".log"))
                    for _ in range(args.repeat)]
        finally:
            shutil.rmtree(directory, ignore_errors=True)
        served = statistics.median(r[0] for r in runs)
        replay = statistics.median(r[1] for r in runs)
        print(f"{keys:>9}  {'snapshot' if args.compacted else 'journal':>9}  {size:>11,}  {replay:>11.3f}s  "
              f"{served:>21.3f}s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
