"""FileStore's cost per operation in one client VM (tests/platforms/bench_nfs.py runs it):

    python3 bench_filestore.py STORE_PATH OPS

set, get (of a key that exists), add and check, OPS times each after a warm-up, one process,
no contention. Prints one JSON line: microseconds per operation (median of 3 rounds).
"""

import json
import statistics
import sys
import time

from distlib.store.file import FileStore


def per_op(fn, ops: int) -> float:
    rounds = []
    for _ in range(3):
        started = time.perf_counter()
        for i in range(ops):
            fn(i)
        rounds.append((time.perf_counter() - started) / ops * 1e6)
    return statistics.median(rounds)


def main() -> None:
    path, ops = sys.argv[1], int(sys.argv[2])
    store = FileStore(path, -1)
    store.set("k", "v" * 64)
    for _ in range(10):  # warm-up: the file is open in the client's caches
        store.add("n", 1)
    out = {
        "set_us": per_op(lambda i: store.set("k", "v" * 64), ops),
        "get_us": per_op(lambda i: store.get("k"), ops),
        "add_us": per_op(lambda i: store.add("n", 1), ops),
        "check_us": per_op(lambda i: store.check(["k"]), ops),
    }
    store.close()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
