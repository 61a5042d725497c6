"""Small FileStore steps for the failure tests (tests/platforms/test_nfs_failures.py), run in a
client VM. Each prints one JSON line; markers in /tmp (the VM's own disk, never NFS) tell the
host where a step has got to, so the host orders its actions by them.

    store_steps.py open PATH                   construct FileStore(PATH); the error, if any
    store_steps.py crash PATH                  join, set keys, then SIGKILL itself (a crashed run)
    store_steps.py rerun PATH                  what a new run meets on PATH (init_process_group
                                               with it), then the way out the error documents
    store_steps.py wait PATH KEY TIMEOUT_S     join, set "waiting", touch /tmp/waiting, wait for KEY
    store_steps.py set PATH KEY TIMEOUT_S      join, set KEY
    store_steps.py stalled PATH BOUND_S        join, touch /tmp/joined, wait for /tmp/go, then
                                               set (the server is down by then): bounded by BOUND_S
"""

import datetime
import json
import logging
import os
import re
import signal
import sys
import time

from distlib.store import file as file_module
from distlib.store.file import FileStore


def say(**out) -> None:
    print(json.dumps(out), flush=True)


def touch(path: str) -> None:
    open(path, "w").close()


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    step, path = sys.argv[1], sys.argv[2]
    started = time.monotonic()
    if step == "open":
        try:
            FileStore(path, 2).close()
            say(ok=True)
        except Exception as exc:
            say(error=f"{type(exc).__name__}: {exc}")
    elif step == "crash":
        store = FileStore(path, 2)
        for i in range(3):
            store.set(f"old/{i}", "from the run that crashed")
        os.kill(os.getpid(), signal.SIGKILL)
    elif step == "rerun":
        import distlib as dist

        url = f"file://{path}"
        out = {}
        try:
            dist.init_process_group("gloo", init_method=url, rank=0, world_size=1,
                                    timeout=datetime.timedelta(seconds=60))
            out["first"] = "joined"
        except Exception as exc:
            out["first"] = f"{type(exc).__name__}: {exc}"
            # the way out the error names: remove the files it lists, start again
            named = re.search(r"Remove (\S+) and (\S+?) and start again", str(exc))
            out["removed"] = list(named.groups()) if named else []
            for name in out["removed"]:
                os.remove(name)
            dist.init_process_group("gloo", init_method=url, rank=0, world_size=1,
                                    timeout=datetime.timedelta(seconds=60))
            out["second"] = "joined"
            look = FileStore(path, -1)
            out["old_keys_seen"] = look.check(["old/0"])
            look.close()
        dist.destroy_process_group()
        say(**out)
    elif step == "wait":
        key, timeout = sys.argv[3], float(sys.argv[4])
        store = FileStore(path, -1)
        store.set_timeout(timeout)
        store.set("waiting", "1")
        touch("/tmp/waiting")
        try:
            store.wait([key])
            say(value=store.get(key).decode(), seconds=time.monotonic() - started)
        except Exception as exc:
            say(error=f"{type(exc).__name__}: {exc}", seconds=time.monotonic() - started)
        store.close()
    elif step == "set":
        key, timeout = sys.argv[3], float(sys.argv[4])
        try:
            store = FileStore(path, -1)
        except Exception as exc:  # refused: say why (the lost-lock test asserts it was not)
            say(error=f"{type(exc).__name__}: {exc}", seconds=time.monotonic() - started)
            return
        store.set_timeout(timeout)
        store.set(key, "set after the restart")
        say(ok=True, seconds=time.monotonic() - started)
        store.close()
    elif step == "stalled":
        bound = float(sys.argv[3])
        file_module.MIN_LOCK_WAIT_S = bound  # the bound of every operation (at least 30 s by default)
        store = FileStore(path, -1)
        store.set_timeout(bound)
        touch("/tmp/joined")
        while not os.path.exists("/tmp/go"):
            time.sleep(0.05)
        begun = time.monotonic()
        try:
            store.set("k", "v")
            say(ok=True, seconds=time.monotonic() - begun)
        except Exception as exc:
            say(error=f"{type(exc).__name__}: {exc}", seconds=time.monotonic() - begun)
        os._exit(0)  # the blocked call and the store's close would wait for the server
    else:
        raise SystemExit(f"unknown step {step}")


if __name__ == "__main__":
    main()
