"""One side of the two-client FileStore scenario (tests/platforms/test_nfs_filestore.py), run
in a client VM on an NFS mount:

    python3 filestore_pair.py a|b STORE_PATH

Both sides open the same store file; every step starts when both have reached it (each
sets ``<step>/<side>`` and waits for the other's), so the steps are ordered by the store's
own events, never by sleeps. Prints one JSON line: what this side saw.

1. ``add``: side a adds 1, side b adds 1000, ADDS times each, keeping every total returned;
2. ``compare_set``: both race compare_set("winner", "", side);
3. ``wait``: a announces it is about to wait, then waits for "from-b"; b sets it once it has
   seen a's announcement;
4. ``delete_key``: b deletes "from-b" once a has read it (True), then again (False); a checks
   it is gone;
5. ``num_keys``: both count the keys after a meeting, and leave only once both have counted.
"""

import json
import sys
import time

from distlib.store.file import FileStore

ADDS = 20


def main() -> None:
    side, path = sys.argv[1], sys.argv[2]
    other = "b" if side == "a" else "a"
    out = {"side": side}
    store = FileStore(path, 2)
    store.set_timeout(180)

    def meet(step: str) -> None:
        store.set(f"{step}/{side}", "1")
        store.wait([f"{step}/{other}"])

    meet("ready")
    amount = 1 if side == "a" else 1000
    out["totals"] = [store.add("sum", amount) for _ in range(ADDS)]
    meet("added")
    out["sum"] = int(store.get("sum"))

    meet("race")
    out["compare_set"] = store.compare_set("winner", "", side).decode()

    if side == "a":
        out["before_wait"] = store.check(["from-b"])
        store.set("a-waiting", "1")
        started = time.monotonic()
        store.wait(["from-b"])
        out["waited_s"] = time.monotonic() - started
        out["woken_by"] = store.get("from-b").decode()
        store.set("a-woke", "1")
        store.wait(["deleted"])
        out["after_delete"] = store.check(["from-b"])
    else:
        store.wait(["a-waiting"])
        store.set("from-b", "set by b")
        store.wait(["a-woke"])
        out["delete_first"] = store.delete_key("from-b")
        out["delete_again"] = store.delete_key("from-b")
        store.set("deleted", "1")

    meet("done")
    out["num_keys"] = store.num_keys()
    out["keys"] = sorted(store.list_keys())
    # neither side closes (which writes keys) before the other has counted; this last meeting
    # adds no key: each side overwrites its own "done/<side>", and polls the other's
    store.set(f"done/{side}", "counted")
    while store.get(f"done/{other}") != b"counted":
        time.sleep(0.05)
    store.close()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
