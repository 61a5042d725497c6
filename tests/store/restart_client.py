"""One client process of tests/store/test_master_restart.py, run as
``python -m tests.store.restart_client MODE PORT [ARGS]``: it talks to a master service that the
test kills (-9) and starts again, and prints what it did on stdout (its log, the outage lines
among it, goes to stderr).

Modes: ``adds ID`` (ADD 1 to ``counter`` until the key ``stop`` exists; prints how many ADDs
it issued), ``barrier ID`` (a store BARRIER of 4 participants; prints ``passed``), ``rank RANK``
(init_process_group of 4 ranks through the master service, an all_reduce; prints the sum).
"""

from __future__ import annotations

import logging
import os
import sys
from datetime import timedelta


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    mode, port, who = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    if mode == "rank":
        import numpy as np

        import distlib as dist

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(who), WORLD_SIZE="4",
                          DISTLIB_EXTERNAL_STORE="1")
        print("joining", flush=True)
        dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=60))
        data = np.array([who + 1], dtype=np.int64)
        dist.all_reduce(data)
        print(f"sum {int(data[0])}", flush=True)
        dist.destroy_process_group()
        return
    from distlib.store.tcp import TCPStore

    store = TCPStore("127.0.0.1", port, timeout=timedelta(seconds=60))
    if mode == "adds":
        store.set(f"started/{who}", b"1")
        issued = 0
        while True:
            store.add("counter", 1)
            issued += 1
            if issued % 20 == 0 and store.check(["stop"]):
                break
        print(f"issued {issued}", flush=True)
    elif mode == "barrier":
        print("arriving", flush=True)
        store.barrier("the-barrier", 4, timedelta(seconds=60))
        print("passed", flush=True)
    store.close()


if __name__ == "__main__":
    main()
