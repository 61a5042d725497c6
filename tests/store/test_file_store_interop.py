"""torch's FileStore and distlib's FileStore on one file: each sees the other's writes.

Needs torch (2.13) importable: ``make test-interop``. The two implementations in one process
use separate open files, so their flock() locks exclude each other exactly as between
processes; one test also runs torch and distlib *processes* against one counter.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import subprocess
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="torch not importable: run `make test-interop`")
import torch.distributed as tdist  # noqa: E402

from distlib.store import file_log  # noqa: E402
from distlib.store.file import SIDECAR_SUFFIX, FileStore  # noqa: E402

pytestmark = pytest.mark.interop


def _del(obj_holder: list) -> None:
    """Drop the last reference to a torch store so its C++ destructor runs now."""
    obj_holder.clear()
    gc.collect()


def _exchange(first, second, tag: str) -> None:
    """set/get/add/compare_set/delete/check/num_keys/list_keys both ways between two stores."""
    first.set(tag + "a", "from-first")
    assert second.get(tag + "a") == b"from-first"
    second.set(tag + "b", b"\x00from-second\xff")
    assert first.get(tag + "b") == b"\x00from-second\xff"

    assert first.add(tag + "cnt", 5) == 5
    assert second.add(tag + "cnt", 2) == 7
    assert first.add(tag + "cnt", -1) == 6
    assert second.get(tag + "cnt") == b"6"

    assert first.compare_set(tag + "cs", "", "one") == b"one"
    assert second.compare_set(tag + "cs", "nope", "two") == b"one"
    assert second.compare_set(tag + "cs", "one", "two") == b"two"
    assert first.get(tag + "cs") == b"two"
    assert first.compare_set(tag + "absent", "x", "y") == b"x"
    assert not second.check([tag + "absent"])

    assert second.delete_key(tag + "a") is True
    assert not first.check([tag + "a"])
    assert first.delete_key(tag + "b") is True
    assert not second.check([tag + "b"])
    assert first.check([tag + "cnt", tag + "cs"]) and second.check([tag + "cnt", tag + "cs"])

    assert first.num_keys() == second.num_keys()
    assert sorted(first.list_keys()) == sorted(second.list_keys())
    first.set_timeout(timedelta(seconds=5))
    second.set_timeout(timedelta(seconds=5))
    first.wait([tag + "cs"])
    second.wait([tag + "cs"])


def test_distlib_created_then_torch_joins(tmp_path):
    path = str(tmp_path / "store")
    ours = FileStore(path, 2)
    theirs = [tdist.FileStore(path, 2)]
    _exchange(ours, theirs[0], "x/")
    _exchange(theirs[0], ours, "y/")
    ours.close()  # first to leave: refcount 1, file kept
    assert os.path.exists(path)
    assert not os.path.exists(path + SIDECAR_SUFFIX)  # no distlib user left
    _del(theirs)  # torch's destructor: refcount 0, cleanup 2 >= 2: unlink
    assert not os.path.exists(path)


def test_torch_created_then_distlib_joins(tmp_path):
    path = str(tmp_path / "store")
    theirs = [tdist.FileStore(path, 2)]
    ours = FileStore(path, 2)
    _exchange(theirs[0], ours, "x/")
    _exchange(ours, theirs[0], "y/")
    _del(theirs)
    assert os.path.exists(path)
    ours.close()  # last user: distlib unlinks, as torch would
    assert not os.path.exists(path)
    assert not os.path.exists(path + SIDECAR_SUFFIX)


def test_clone_and_refcount_arithmetic_shared(tmp_path):
    path = str(tmp_path / "store")
    theirs = [tdist.FileStore(path, 3)]
    ours = FileStore(path, 3)
    ours_clone = ours.clone()
    records = [k for _, k, _ in file_log.iter_records(Path(path).read_bytes())]
    assert records.count(b"refcount/") == 3
    ours_clone.close()
    _del(theirs)
    assert os.path.exists(path)
    ours.close()
    assert not os.path.exists(path)


def test_live_torch_user_does_not_look_like_a_crashed_run(tmp_path):
    path = str(tmp_path / "store")
    first = FileStore(path, -1)
    theirs = [tdist.FileStore(path, -1)]
    first.set("k", "v")
    first.close()  # the only distlib user leaves; torch still holds a refcount
    with FileStore(path, -1) as again:  # must join, not report a stale file
        assert again.get("k") == b"v"
    _del(theirs)


SCRIPT = [
    ("set", "a", "hello"),
    ("set", "bin", b"\x00\xff"),
    ("add", "cnt", 5),
    ("add", "cnt", -2),
    ("compare_set", "cs", "x", "y"),
    ("compare_set", "cs", "", "first"),
    ("compare_set", "cs", "first", "second"),
    ("delete_key", "a"),
    ("delete_key", "never"),
    ("append", "ap", "po"),
    ("append", "ap", "tato"),
    ("multi_set", ["m1", "m2"], ["1", "2"]),
    ("barrier", "fb", 1),
    ("set", "-x", "1"),
    ("delete_key", "-x"),
    ("set", "", "empty key"),  # the file key "/": a user's empty key is not an empty record key
    ("set", "", ""),
    ("delete_key", ""),
    ("set", "", "again"),
]


def _play(store) -> None:
    for op, *args in SCRIPT:
        getattr(store, op)(*args)


def test_same_calls_give_identical_files(tmp_path):
    torch_path, our_path = str(tmp_path / "torch"), str(tmp_path / "ours")
    theirs = [tdist.FileStore(torch_path, -1)]
    _play(theirs[0])
    _del(theirs)
    ours = FileStore(our_path, -1)
    _play(ours)
    ours.close()
    assert Path(our_path).read_bytes() == Path(torch_path).read_bytes()


def test_the_empty_user_key_is_shared_and_never_read_as_damage(tmp_path):
    """distlib reads an empty record key as damage; torch's set("") writes the key "/", so
    stores of both see each other's empty user key."""
    path = str(tmp_path / "store")
    theirs = [tdist.FileStore(path, -1)]
    theirs[0].set("", "from torch")
    with FileStore(path, -1) as ours:
        assert ours.get("") == b"from torch"
        ours.set("", "from distlib")
        assert theirs[0].get("") == b"from distlib"
    assert all(k for _, k, _ in file_log.iter_records(Path(path).read_bytes()))
    assert file_log.record_end(Path(path).read_bytes()) == os.path.getsize(path)
    _del(theirs)


def test_torch_get_is_woken_by_a_distlib_process(tmp_path):
    path = str(tmp_path / "store")
    theirs = tdist.FileStore(path, -1)
    theirs.set_timeout(timedelta(seconds=30))
    code = (
        "import sys, time\n"
        "from distlib.store.file import FileStore\n"
        "with FileStore(sys.argv[1], -1) as s:\n"
        "    time.sleep(0.3)\n"
        "    s.set('late', 'from distlib')\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code, path])
    try:
        assert theirs.get("late") == b"from distlib"
    finally:
        assert child.wait(timeout=60) == 0


# -- torch processes and distlib processes on one counter -----------------------------------------

CTX = multiprocessing.get_context("spawn")


def _mixed_adder(kind, path, times, results):
    try:
        if kind == "torch":
            import torch.distributed as td

            store = td.FileStore(path, -1)
        else:
            store = FileStore(path, -1)
        store.set_timeout(timedelta(seconds=120))
        store.add("ready", 1)
        store.wait(["go"])
        for _ in range(times):
            store.add("counter", 1)
        if kind != "torch":
            store.close()
        else:
            del store
        results.put(("ok", kind, None))
    except BaseException:  # noqa: BLE001
        results.put(("error", kind, traceback.format_exc()))


def test_torch_and_distlib_processes_add_to_one_counter(tmp_path):
    path = str(tmp_path / "mixed")
    kinds = ["torch", "distlib", "torch", "distlib"]
    times = 500
    main = FileStore(path, -1)
    main.set_timeout(timedelta(seconds=180))
    results = CTX.Queue()
    procs = [CTX.Process(target=_mixed_adder, args=(k, path, times, results), daemon=True) for k in kinds]
    for p in procs:
        p.start()
    try:
        deadline = time.monotonic() + 180
        while not main.check(["ready"]) or int(main.get("ready")) < len(kinds):
            assert time.monotonic() < deadline, "children never got ready"
            time.sleep(0.05)
        main.set("go", "1")
        errors = []
        for _ in procs:
            status, kind, value = results.get(timeout=180)
            if status == "error":
                errors.append(f"--- {kind} child ---\n{value}")
        assert not errors, "\n".join(errors)
        assert main.get("counter") == str(len(kinds) * times).encode()
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
        main.close()
