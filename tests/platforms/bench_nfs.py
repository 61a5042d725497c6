"""FileStore on NFS against a local file, measured on real NFS clients (VMs): the table of
docs/stores-filestore.md ("On NFS").

    sudo .venv/bin/python -m tests.platforms.bench_nfs [--image distlib:cpu] [--ops 50] [--runs 2]

Boots the fixture of the NFS tests (vm_nfs.start: the kernel server VM, 3 client VMs, the
Compose cluster's nfs-ganesha container on loopback; the VM image is built once and cached),
then, on each mount and on the first client's own disk (tmpfs, the local file):

* set / get / add / check: microseconds per operation, one client, no contention
  (guest/bench_filestore.py; median of 3 rounds of --ops operations);
* rendezvous: init_process_group on a FileStore there, 2 and 3 ranks, one per client VM (the
  local file: 2 and 3 processes in the first client, since no other host can see its disk),
  the slowest rank's time (guest/rendezvous.py).

Every VM is emulated (TCG): absolute times are several times a real host's; compare the rows
with each other. Prints a Markdown table per run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid
from typing import Dict, List

from tests.support import vm as vm_module
from tests.support import vm_nfs
from tests.support.vm_nfs import script, side_by_side

LAN = {"GLOO_SOCKET_IFNAME": "eth1"}
PLACES = ("local", "nfs4.2", "nfs3", "ganesha-nfs4.1")


def directory(hosts: vm_nfs.NfsHosts, place: str) -> str:
    if place == "local":
        path = f"/dev/shm/bench-{uuid.uuid4().hex[:8]}"
        hosts.clients[0].run(["mkdir", "-p", path], timeout=30).check()
        return path
    return hosts.new_dir(place, "bench")


def rendezvous_s(hosts: vm_nfs.NfsHosts, place: str, world: int) -> float:
    url = f"file://{directory(hosts, place)}/store"
    vms = [hosts.clients[0]] * world if place == "local" else hosts.clients[:world]
    results = side_by_side(*[(lambda vm=vm, rank=rank: script(vm, "rendezvous.py", ["120", url, str(rank), str(world)],
                                                              300, LAN)) for rank, vm in enumerate(vms)])
    for got in results:
        if "error" in got:
            raise RuntimeError(f"{place}: {got['vm']}: {got['error']}")
    return max(got["init_s"] for got in results)


def measure(hosts: vm_nfs.NfsHosts, ops: int) -> Dict[str, Dict[str, float]]:
    rows: Dict[str, Dict[str, float]] = {}
    for place in PLACES:
        got = script(hosts.clients[0], "bench_filestore.py", [f"{directory(hosts, place)}/store", str(ops)], 600)
        rows[place] = {k: got[k] for k in ("set_us", "get_us", "add_us", "check_us")}
        for world in (2, 3):
            rows[place][f"rdzv{world}_s"] = rendezvous_s(hosts, place, world)
    return rows


def table(rows: Dict[str, Dict[str, float]]) -> str:
    local = rows["local"]
    out = ["| where | set | get | add | check | rendezvous, 2 hosts | rendezvous, 3 hosts |",
           "|---|---|---|---|---|---|---|"]
    for place, row in rows.items():
        cells = [f"{row[k] / 1000:.2f} ms" + ("" if place == "local" else f" ({row[k] / local[k]:.0f}x)")
                 for k in ("set_us", "get_us", "add_us", "check_us")]
        cells += [f"{row[k]:.2f} s" for k in ("rdzv2_s", "rdzv3_s")]
        out.append(f"| {place} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main(argv: List[str] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--image", default="distlib:cpu", help="the distlib image the NFS server image builds on")
    parser.add_argument("--ops", type=int, default=50)
    parser.add_argument("--runs", type=int, default=2)
    args = parser.parse_args(argv)
    image = vm_module.ensure_image("nfs-vm")
    started = time.monotonic()
    with vm_nfs.start(image, clients=3, ganesha_image=args.image) as hosts:
        print(f"fixture up in {time.monotonic() - started:.0f} s", flush=True)
        runs = []
        for n in range(args.runs):
            rows = measure(hosts, args.ops)
            runs.append(rows)
            print(f"\nrun {n + 1}:\n{table(rows)}", flush=True)
        if len(runs) > 1:
            median = {p: {k: statistics.median(r[p][k] for r in runs) for k in runs[0][p]} for p in runs[0]}
            print(f"\nmedian of {len(runs)} runs:\n{table(median)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
