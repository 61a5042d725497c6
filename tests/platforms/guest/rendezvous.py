"""One rank of a rendezvous on an NFS-backed FileStore, run in a client VM
(tests/platforms/test_nfs_rendezvous.py and test_nfs_failures.py):

    python3 rendezvous.py TIMEOUT_S [URL RANK WORLD_SIZE]

With URL: ``init_process_group("gloo", init_method=URL, rank=RANK, world_size=WORLD_SIZE)``.
Without: ``init_process_group("gloo")``, as a user's unmodified script calls it, the rank,
size and init method coming from the environment the launcher gives (RANK, WORLD_SIZE,
MASTER_ADDR, DISTLIB_INIT_METHOD, ...). Then an all_reduce (SUM) of ``rank + 1`` over the
VMs' LAN. Prints one JSON line: the result, or the error the rank got, and the seconds.

With RENDEZVOUS_AFTER=FILE in the environment the rank starts Python and imports everything,
then waits for FILE (on the VM's own disk) before init_process_group: the host then starts it
the moment it wants, without Python's start-up time.
"""

import datetime
import json
import os
import socket
import sys
import time

import numpy as np

import distlib as dist


def main() -> None:
    timeout = datetime.timedelta(seconds=float(sys.argv[1]))
    out = {"host": socket.gethostname()}
    after = os.environ.get("RENDEZVOUS_AFTER")
    while after and not os.path.exists(after):
        time.sleep(0.05)
    started = time.monotonic()
    try:
        if len(sys.argv) > 2:
            url, rank, world = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
            dist.init_process_group("gloo", init_method=url, rank=rank, world_size=world, timeout=timeout)
        else:
            dist.init_process_group("gloo", timeout=timeout)
        out["init_s"] = time.monotonic() - started
        rank = dist.get_rank()
        x = np.full(4, rank + 1, np.int64)
        dist.all_reduce(x)
        out.update(rank=rank, world=dist.get_world_size(), all_reduce=x.tolist())
        dist.destroy_process_group()
    except Exception as exc:  # the test reads what the rank was told
        out["error"] = f"{type(exc).__name__}: {exc}"
    out["seconds"] = time.monotonic() - started
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
