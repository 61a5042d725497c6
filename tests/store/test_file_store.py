"""FileStore: torch 2.13's byte layout, refcount/cleanup rules and quirks, plus distlib's
additions (precise timeouts, fail-fast missing directory, damage and stale-file detection,
NFS lock checks). The shared semantic suite (test_store_semantics.py) covers the API.

Expected bytes come from data/filestore_capture.txt (torch 2.13's real output, captured by
the team with torch 2.13.0+cpu); the file images the tests compare with are also kept in
data/torch_filestore_images.json, checked against the capture here.
"""

from __future__ import annotations

import errno
import fcntl
import gc
import json
import os
import re
import signal
import struct
import subprocess
import sys
import textwrap
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest

from distlib import DistStoreError
from distlib.store import PrefixStore
from distlib.store import file as file_mod
from distlib.store import file_locks, file_log, file_mounts
from distlib.store.file import SIDECAR_SUFFIX, FileStore
from distlib.store.file_mounts import MountInfo, check_mount, find_mount, lock_problem, parse_mountinfo

DATA = Path(__file__).resolve().parent / "data"
#: torch 2.13's own output: each step of a FileStore session and the store file after it.
CAPTURE = DATA / "filestore_capture.txt"
#: The file images the tests compare with, taken from CAPTURE (test_images_match_the_capture
#: checks that they still agree).
IMAGES = DATA / "torch_filestore_images.json"

# torch 2.13: FileStore(path, 2) on a new file, then set('a', 'hello') (captures/filestore.txt)
TORCH_AFTER_CTOR = bytes.fromhex("09000000 72656663 6f756e74 2f 01000000 31")
TORCH_AFTER_SET_A = TORCH_AFTER_CTOR + bytes.fromhex("02000000 2f61 05000000 68656c6c6f")


def capture_image(title: str) -> bytes:
    """The bytes of torch's store file after the step ``title`` of the capture."""
    return bytes.fromhex(json.loads(IMAGES.read_text())["images"][title])


def image_in_capture(text: str, title: str) -> bytes:
    """The file bytes the capture shows under the section whose header starts with title."""
    start = text.index("## " + title)
    end = text.find("\n## ", start + 3)
    section = text[start : end if end != -1 else len(text)]
    data = bytearray()
    for match in re.finditer(r"^\s+[0-9a-f]{6}  ((?:[0-9a-f]{2} )+)", section, re.M):
        data += bytes.fromhex(match.group(1))
    return bytes(data)


def test_images_match_the_capture():
    text = CAPTURE.read_text()
    for title, data in json.loads(IMAGES.read_text())["images"].items():
        assert image_in_capture(text, title).hex() == data, title


def rec(key: bytes, value: bytes) -> bytes:
    return struct.pack("<I", len(key)) + key + struct.pack("<I", len(value)) + value


def records(path) -> list:
    return [(k, v) for _, k, v in file_log.iter_records(Path(path).read_bytes())]


@pytest.fixture
def path(tmp_path):
    return str(tmp_path / "store")


# -- byte layout --------------------------------------------------------------------------------


def test_constructor_and_set_bytes_match_torch(path):
    with FileStore(path, 2) as store:
        assert Path(path).read_bytes() == TORCH_AFTER_CTOR
        store.set("a", "hello")
        assert Path(path).read_bytes() == TORCH_AFTER_SET_A


def test_embedded_images_agree_with_capture():
    assert capture_image("s1 = FileStore(path, world_size=2)") == TORCH_AFTER_CTOR
    assert capture_image("s1.set('a', 'hello')") == TORCH_AFTER_SET_A


def test_whole_capture_session_is_byte_identical(path):
    """Replays the capture's script; the file must equal torch's after each writer leaves."""
    s1 = FileStore(path, 2)
    s1.set("a", "hello")
    s1.set("bin", b"\x00\xff")
    assert s1.add("cnt", 5) == 5
    assert s1.add("cnt", -2) == 3
    s1.set("a", "world")
    assert s1.compare_set("cs", "x", "y") == b"x"
    assert s1.compare_set("cs", "", "first") == b"first"
    assert s1.compare_set("cs", "first", "second") == b"second"
    assert s1.compare_set("cs", "nope", "third") == b"second"
    assert s1.num_keys() == 5
    assert s1.list_keys() == ["cs", "cnt", "bin", "a", "efcount/"]
    assert s1.delete_key("a") is True
    assert s1.delete_key("never-existed") is False  # torch says True; its tombstone is written all the same
    assert Path(path).read_bytes() == capture_image("s1.delete_key('never-existed')")
    assert s1.num_keys() == 4
    s1.append("ap", "po")
    s1.append("ap", "tato")
    s1.multi_set(["m1", "m2"], ["1", "2"])
    assert s1.multi_get(["m1", "m2"]) == [b"1", b"2"]
    s1.barrier("fb", 1)
    PrefixStore("pre", s1).set("k", "v")
    s1.set("-x", "1")
    s1.delete_key("-x")
    assert Path(path).read_bytes() == capture_image("s1.delete_key('-x')")
    s2 = FileStore(path, 2)
    s3 = s1.clone()
    assert Path(path).read_bytes() == capture_image("s3 = s1.clone()")
    del s3
    gc.collect()
    assert Path(path).read_bytes() == capture_image("del s3 (destructor)")
    s2.close()
    assert Path(path).read_bytes() == capture_image("del s2")
    s1.close()
    assert not os.path.exists(path)
    assert not os.path.exists(path + SIDECAR_SUFFIX)


def test_tombstones_and_keys_starting_with_dash(path):
    with FileStore(path) as store:
        store.set("-x", "1")
        assert store.delete_key("-x") is True
        assert store.delete_key("never") is False  # torch: True always; the tombstone is written anyway
        assert records(path)[1:] == [(b"/-x", b"1"), (b"-/-x", b""), (b"-/never", b"")]
        assert not store.check(["-x"])
        store.set("-x", "again")
        assert store.get("-x") == b"again"


def test_delete_key_says_whether_the_key_was_in_the_file(path):
    """Not whether this process had seen it: each FileStore catches up under the lock first.
    (torch's FileStore returns True always, which tells a caller nothing.)"""
    first, second = FileStore(path), FileStore(path)
    try:
        first.set("k", "1")
        assert second.delete_key("k") is True  # set by the other store, not seen here yet
        assert first.delete_key("k") is False  # deleted by the other store meanwhile
        assert second.delete_key("k") is False
        second.set("k", "2")
        assert first.delete_key("k") is True
        assert records(path)[-4:] == [(b"-/k", b""), (b"-/k", b""), (b"/k", b"2"), (b"-/k", b"")]
    finally:
        first.close()
        second.close()


def test_add_writes_decimal_records_and_wraps_int64(path):
    with FileStore(path) as store:
        assert store.add("c", 5) == 5
        assert store.add("c", -7) == -2
        assert store.add("big", 2**62) == 2**62
        assert store.add("big", 2**62) == -(2**63)
        assert records(path)[1:] == [
            (b"/c", b"5"),
            (b"/c", b"-2"),
            (b"/big", str(2**62).encode()),
            (b"/big", str(-(2**63)).encode()),
        ]


def test_add_on_non_numeric_value_names_the_key(path):
    with FileStore(path) as store:
        store.set("word", "hello")
        with pytest.raises(ValueError, match="stoll.*'word'"):
            store.add("word", 1)
        assert records(path)[-1] == (b"/word", b"hello")  # nothing written
        store.set("padded", " 12 ")
        assert store.add("padded", 1) == 13  # strtoll rules


def test_compare_set_appends_only_when_it_writes(path):
    with FileStore(path) as store:
        size = os.path.getsize(path)
        assert store.compare_set("k", "x", "y") == b"x"
        assert os.path.getsize(path) == size
        assert store.compare_set("k", "", "v1") == b"v1"
        assert store.compare_set("k", "nope", "v2") == b"v1"
        assert store.compare_set("k", "v1", "v2") == b"v2"
        assert records(path)[1:] == [(b"/k", b"v1"), (b"/k", b"v2")]


def test_generic_append_leaves_compare_set_records(path):
    with FileStore(path) as store:
        assert store.has_extended_api() is False
        store.append("ap", "po")
        store.append("ap", b"tato")
        assert store.get("ap") == b"potato"
        assert records(path)[1:] == [(b"/ap", b"po"), (b"/ap", b"potato")]


def test_values_str_as_utf8_get_returns_bytes(path):
    with FileStore(path) as store:
        store.set("u", "héllo ✓")
        assert store.get("u") == "héllo ✓".encode()
        store.set("ключ", b"\x00")
        assert records(path)[-1] == ("/ключ".encode(), b"\x00")
        with pytest.raises(TypeError):
            store.set(b"bytes-key", "v")
        with pytest.raises(TypeError):
            store.get(5)


def test_queues_raise_as_torch(path):
    with FileStore(path) as store:
        for call in (lambda: store.queue_push("q", "x"), lambda: store.queue_pop("q"), lambda: store.queue_len("q")):
            with pytest.raises(NotImplementedError, match="queue support is not implemented."):
                call()


def test_num_keys_and_list_keys_quirks(path):
    with FileStore(path) as store:
        store.set("a", "1")
        store.set("b", "2")
        assert store.num_keys() == 3  # + refcount/
        assert sorted(store.list_keys()) == ["a", "b", "efcount/"]
        other = store.clone()
        other.close()  # writes cleanup/
        assert store.num_keys() == 4
        assert sorted(store.list_keys()) == ["a", "b", "efcount/", "leanup/"]
        store.delete_key("a")
        assert store.num_keys() == 3


# -- refcount and cleanup (torch §3.3) -----------------------------------------------------------


def test_world_size_two_with_two_users_removes_file(path):
    a = FileStore(path, 2)
    b = FileStore(path, 2)
    assert os.path.exists(path + SIDECAR_SUFFIX)
    a.close()
    assert os.path.exists(path)
    b.close()
    assert not os.path.exists(path)
    assert not os.path.exists(path + SIDECAR_SUFFIX)


def test_world_size_minus_one_keeps_file(tmp_path):
    p2 = str(tmp_path / "p2")
    store = FileStore(p2)
    store.set("k", "v")
    store.close()
    assert Path(p2).read_bytes() == capture_image("FileStore(p2) world_size default (-1); set; del")
    assert not os.path.exists(p2 + SIDECAR_SUFFIX)  # no users left: the side file goes


def test_three_sequential_users_with_world_size_three(tmp_path):
    p3 = str(tmp_path / "p3")
    FileStore(p3, 3).close()
    assert os.path.exists(p3)
    FileStore(p3, 3).close()
    assert Path(p3).read_bytes() == capture_image("FileStore(p3, 3) again, then del")
    FileStore(p3, 3).close()
    assert not os.path.exists(p3)


def test_del_of_last_reference_runs_the_destructor(path):
    store = FileStore(path, 1)
    store.set("k", "v")
    del store
    gc.collect()
    assert not os.path.exists(path)


def test_close_is_idempotent_and_context_manager(path):
    with FileStore(path, 1) as store:
        store.set("k", "v")
    assert store.closed
    store.close()
    assert not os.path.exists(path)
    with pytest.raises(DistStoreError, match="closed"):
        store.get("k")


def test_clone_adds_a_user_and_keeps_timeout(path):
    with FileStore(path, 2) as store:
        store.set_timeout(timedelta(seconds=7))
        clone = store.clone()
        assert clone.timeout == timedelta(seconds=7)
        assert records(path)[-1] == (b"refcount/", b"2")
        clone.set("from-clone", "1")
        assert store.get("from-clone") == b"1"
        clone.close()
    assert not os.path.exists(path)


def test_file_prefilled_by_another_writer_is_read(path):
    Path(path).write_bytes(rec(b"/zz", b"42"))
    with FileStore(path) as store:
        assert store.get("zz") == b"42"
        assert store.num_keys() == 2
    # records from a writer that appends later are read too
    with FileStore(path) as store:
        with open(path, "ab") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            f.write(rec(b"/late", b"1") + rec(b"-/zz", b""))
        assert store.get("late") == b"1"
        assert not store.check(["zz"])


def test_describe_and_repr(path):
    with FileStore(path) as store:
        assert store.describe() == f"FileStore {path}"
        assert path in repr(store)


def test_relative_path_is_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with FileStore("rel", 1) as store:
        assert store.path == str(tmp_path / "rel")
        monkeypatch.chdir("/")
        store.set("k", "v")  # still the same file after a chdir
        assert store.get("k") == b"v"


# -- timeouts -----------------------------------------------------------------------------------


def test_get_timeout_names_key_and_file_and_is_precise(path):
    with FileStore(path) as store:
        store.set_timeout(timedelta(seconds=0.5))
        start = time.monotonic()
        with pytest.raises(DistStoreError) as info:
            store.get("missing-key")
        elapsed = time.monotonic() - start
    assert isinstance(info.value, RuntimeError)
    text = str(info.value)
    assert text.startswith("wait timeout after 500ms, keys: missing-key")
    assert path in text
    # precise (torch rounds to whole seconds and would take >= 1 s here)
    assert 0.5 <= elapsed < 0.95


def test_wait_timeout_names_only_the_missing_keys(path):
    with FileStore(path) as store:
        store.set("here", "1")
        start = time.monotonic()
        with pytest.raises(DistStoreError, match=r"keys: gone \(") as info:
            store.wait(["here", "gone"], timedelta(seconds=0.3))
        elapsed = time.monotonic() - start
    assert f"FileStore {path}" in str(info.value)
    assert 0.3 <= elapsed < 0.8


def test_zero_timeout_does_not_wait(path):
    with FileStore(path) as store:
        store.set("k", "v")
        store.wait(["k"], 0)  # present: fine
        start = time.monotonic()
        with pytest.raises(DistStoreError):
            store.wait(["missing"], timedelta(0))
        store.set_timeout(0)
        with pytest.raises(DistStoreError):
            store.get("missing")
        assert store.get("k") == b"v"
        assert time.monotonic() - start < 0.25


def test_get_wakes_up_when_another_process_sets(path):
    with FileStore(path) as store:
        store.set_timeout(timedelta(seconds=20))
        code = f"""
import time
from distlib.store.file import FileStore
with FileStore({path!r}) as s:
    time.sleep(0.3)
    s.set("late", "value")
"""
        child = subprocess.Popen([sys.executable, "-c", code])
        try:
            assert store.get("late") == b"value"
        finally:
            assert child.wait(timeout=30) == 0


# -- errors -------------------------------------------------------------------------------------


def test_missing_directory_fails_at_once_naming_it(tmp_path):
    target = tmp_path / "no" / "such" / "dir" / "store"
    start = time.monotonic()
    with pytest.raises(DistStoreError) as info:
        FileStore(str(target), 1)
    assert time.monotonic() - start < 2
    text = str(info.value)
    assert str(target.parent) in text
    assert f"({tmp_path / 'no'} is missing)" in text


def test_truncated_record_at_open_is_a_clear_error(path):
    Path(path).write_bytes(rec(b"/a", b"1") + rec(b"/bb", b"hello")[:-2])
    with pytest.raises(DistStoreError) as info:
        FileStore(path)
    text = str(info.value)
    assert path in text
    assert "damaged at byte 11" in text
    assert "5-byte value but only 3 byte(s) follow" in text


def test_damage_appearing_later_is_reported_not_misread(path):
    with FileStore(path) as store:
        store.set("a", "1")
        end = os.path.getsize(path)
        with open(path, "ab") as f:
            f.write(b"\x07\x00")  # two stray bytes: half a length field
        with pytest.raises(DistStoreError, match=f"damaged at byte {end}"):
            store.get("a")
        with pytest.raises(DistStoreError, match="damaged"):
            store.set("b", "2")  # never appends after damage
        assert os.path.getsize(path) == end + 2
        os.truncate(path, end)  # repaired: close() can count this user out
    assert records(path)[-1] == (b"refcount/", b"0")
    assert not os.path.exists(path + SIDECAR_SUFFIX)


def test_file_removed_while_waiting_is_an_error_not_a_timeout(path):
    store = FileStore(path)
    store.set_timeout(timedelta(seconds=30))
    timer = threading.Timer(0.2, os.unlink, [path])
    timer.start()
    start = time.monotonic()
    with pytest.raises(DistStoreError, match="no longer exists"):
        store.get("never")
    assert time.monotonic() - start < 10
    timer.join()
    store.close()  # the file is gone: nothing to count (as torch)


def test_file_replaced_under_a_writer_is_detected(path):
    with FileStore(path) as store:
        store.set("a", "1")
        os.unlink(path)
        Path(path).write_bytes(b"")
        with pytest.raises(DistStoreError, match=r"truncated from 29 to 0 bytes under us|replaced by another file"):
            store.set("b", "2")
        os.unlink(path)


def test_busy_lock_wait_is_bounded(path, monkeypatch):
    monkeypatch.setattr(file_mod, "MIN_LOCK_WAIT_S", 0.3)
    store = FileStore(path)
    store.set_timeout(timedelta(seconds=0.3))
    fd = os.open(path, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        start = time.monotonic()
        with pytest.raises(DistStoreError, match="could not lock store file"):
            store.set("k", "v")
        assert time.monotonic() - start < 5
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
    store.set("k", "v")
    store.close()


def test_flock_enolck_gives_a_clear_error_naming_the_mount(path, monkeypatch):
    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(file_locks.fcntl, "flock", no_locks)
    with pytest.raises(DistStoreError) as info:
        FileStore(path)
    text = str(info.value)
    assert "ENOLCK" in text and path in text
    mount = file_mounts.mount_of(path)
    assert mount is not None and f"mount {mount.mount_point}" in text


def test_flock_eopnotsupp_on_nfs_explains_the_lock_service(path, monkeypatch):
    def unsupported(fd, op):
        raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))

    fake = MountInfo("/mnt/shared", "/", "nfs", "srv:/export", ("rw",), ("vers=3", "local_lock=none"))
    monkeypatch.setattr(file_locks.fcntl, "flock", unsupported)
    monkeypatch.setattr(file_locks, "mount_of", lambda p, *a: fake)
    with pytest.raises(DistStoreError) as info:
        FileStore(path)
    text = str(info.value)
    assert re.search("ENOTSUP|EOPNOTSUPP", text) and "/mnt/shared" in text and "srv:/export" in text
    assert "lockd" in text


# -- stale files from crashed runs ---------------------------------------------------------------

CHILD_OPEN_AND_HANG = """
import sys, time
from distlib.store.file import FileStore
s = FileStore(sys.argv[1], int(sys.argv[2]))
s.set("from-dead-run", "1")
print("ready", flush=True)
time.sleep(120)
"""


def _start_child(path: str, world_size: int) -> subprocess.Popen:
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD_OPEN_AND_HANG, path, str(world_size)],
        stdout=subprocess.PIPE,
        text=True,
    )
    line = child.stdout.readline()
    assert line.strip() == "ready", f"child did not start (exit {child.poll()})"
    return child


def test_file_of_a_killed_run_is_detected_naming_both_files(path):
    child = _start_child(path, 2)
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=30)
    with pytest.raises(DistStoreError) as info:
        FileStore(path, 2)
    text = str(info.value)
    assert f"Remove {path} and {path + SIDECAR_SUFFIX}" in text
    assert "refcount 1, cleanup 0" in text
    assert "holds 2 records from an earlier run" in text
    assert Path(path).read_bytes().count(b"refcount/") == 1  # the failed join wrote nothing
    os.unlink(path)
    os.unlink(path + SIDECAR_SUFFIX)
    with FileStore(path, 1) as store:
        assert not store.check(["from-dead-run"])
    assert not os.path.exists(path)


def test_file_with_a_live_user_is_joined(path):
    child = _start_child(path, 2)
    try:
        with FileStore(path, 2) as store:
            assert store.get("from-dead-run") == b"1"
    finally:
        child.kill()
        child.wait(timeout=30)


CHILD_LOSES_ITS_LOCK_AND_WAITS = """
import fcntl, sys
from distlib.store import file_io
from distlib.store.file import FileStore
file_io.RENEW_S = 2.0  # renews 2 s after joining: after the parent's first look, before its second
s = FileStore(sys.argv[1], 2)
s.set("from-live-user", "1")
fcntl.flock(s._log.log.liveness.fd, fcntl.LOCK_UN)  # as an NFS server restart does, unseen
print("ready", flush=True)
s.wait(["go"], __import__("datetime").timedelta(seconds=60))
print(s.get("go").decode(), flush=True)
s.close()
"""


def test_a_live_user_that_lost_its_lock_is_not_taken_for_a_dead_run(path, caplog):
    """An NFS client that missed the server's grace period loses its locks unseen. The live
    user renews its liveness lock while it waits; the joiner, finding counted users but no
    lock, looks again SETTLE_S later and joins instead of calling the file a dead run's."""
    child = subprocess.Popen([sys.executable, "-c", CHILD_LOSES_ITS_LOCK_AND_WAITS, path],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready", f"child did not start (exit {child.poll()})"
        with caplog.at_level("WARNING", logger="distlib.store.file"):
            store = FileStore(path, 2)
        looked_again = [r.getMessage() for r in caplog.records if "looking again" in r.getMessage()]
        assert looked_again, "the joiner found the unlocked side file yet did not say it looks again"
        assert "counts 1 user(s) but none holds the liveness lock" in looked_again[0], looked_again[0]
        assert store.get("from-live-user") == b"1"
        assert Path(path + SIDECAR_SUFFIX).read_text() == "2\n"
        store.set("go", "joined")
        assert child.stdout.readline().strip() == "joined"
        assert child.wait(timeout=30) == 0
        store.close()
    finally:
        child.kill()
        child.wait(timeout=30)
    assert not os.path.exists(path) and not os.path.exists(path + SIDECAR_SUFFIX)


def test_clean_exit_without_close_removes_both_files(path):
    code = "import sys\nfrom distlib.store.file import FileStore\ns = FileStore(sys.argv[1], 1)\ns.set('k', 'v')\n"
    subprocess.run([sys.executable, "-c", code, path], check=True, timeout=60)
    assert not os.path.exists(path)
    assert not os.path.exists(path + SIDECAR_SUFFIX)


def test_torch_created_file_without_side_file_is_joined(path):
    Path(path).write_bytes(rec(b"refcount/", b"1") + rec(b"/k", b"v"))  # a live torch user
    with FileStore(path, 2) as store:
        assert store.get("k") == b"v"
        assert os.path.exists(path + SIDECAR_SUFFIX)
    assert records(path)[-2:] == [(b"cleanup/", b"1"), (b"refcount/", b"1")]
    assert not os.path.exists(path + SIDECAR_SUFFIX)


def test_side_file_left_with_an_empty_store_file_is_reset(path):
    Path(path + SIDECAR_SUFFIX).write_text("3\n")  # users counted, store file gone since
    with FileStore(path, 1) as store:
        store.set("k", "v")
        assert Path(path + SIDECAR_SUFFIX).read_text() == "1\n"
    assert not os.path.exists(path + SIDECAR_SUFFIX)


FORK_SCRIPT = """
import os, sys
from distlib.store.file import FileStore
store = FileStore(sys.argv[1], 2)
pid = os.fork()
if pid == 0:
    store.set("child", "1")
    sys.exit(0)  # a normal interpreter exit: atexit runs the inherited finalizer
_, status = os.waitpid(pid, 0)
assert os.waitstatus_to_exitcode(status) == 0
assert store.get("child") == b"1"
print(store.num_keys(), flush=True)
store.close()
"""


def test_forked_child_does_not_count_the_parents_user_out(path):
    out = subprocess.run(
        [sys.executable, "-c", FORK_SCRIPT, path], check=True, timeout=60, capture_output=True, text=True
    ).stdout
    assert out.split() == ["2"]  # /child + refcount/: the child's exit wrote no cleanup/
    assert records(path)[-2:] == [(b"cleanup/", b"1"), (b"refcount/", b"0")]
    assert [k for k, _ in records(path)].count(b"cleanup/") == 1


FORK_AND_WAIT_SCRIPT = """
import fcntl, os, sys, time
from datetime import timedelta
from distlib.store import file_io
from distlib.store.file import FileStore
file_io.RENEW_S = 0.05
store = FileStore(sys.argv[1], 2)
pid = os.fork()
if pid == 0:  # waits long enough to be due for renewals many times over
    try:
        store.wait(["never"], timedelta(seconds=0.5))
    except Exception:
        pass
    os._exit(0)
os.waitpid(pid, 0)
probe = os.open(sys.argv[1] + ".distlib-live", os.O_RDWR)
try:
    fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
    print("unlocked", flush=True)
except BlockingIOError:
    print("locked", flush=True)
store.close()
"""


def test_a_forked_child_that_waits_leaves_the_parents_liveness_lock_alone(path):
    """The child's descriptor of the side file shares the parent's lock: were the child to
    renew it (and unlock the old descriptor), the parent would be left unlocked, and a joiner
    would take the live parent for a dead run."""
    out = subprocess.run([sys.executable, "-c", FORK_AND_WAIT_SCRIPT, path], check=True, timeout=60,
                         capture_output=True, text=True).stdout
    assert out.split() == ["locked"], f"after the forked child's wait the parent's side-file lock was: {out!r}"


def test_threads_share_one_store_safely(path):
    with FileStore(path) as store:
        clone = store.clone()

        def work(s):
            for _ in range(200):
                s.add("n", 1)
                s.get("n")

        threads = [threading.Thread(target=work, args=(s,)) for s in (store, store, clone, clone)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert store.get("n") == b"800"
        clone.close()


# -- NFS: mount table parsing and lock checks ----------------------------------------------------

MOUNTINFO = textwrap.dedent(
    r"""
    22 1 252:1 / / rw,relatime shared:1 - ext4 /dev/vda1 rw
    30 22 0:26 / /dev/shm rw,nosuid,nodev shared:4 - tmpfs tmpfs rw
    40 22 0:40 / /mnt/nfs3 rw,relatime shared:20 - nfs srv:/export rw,vers=3,rsize=1048576,hard,proto=tcp,nolock,local_lock=all,addr=10.0.0.5
    41 22 0:41 / /mnt/nfs4 rw,relatime shared:21 - nfs4 srv:/data rw,vers=4.2,hard,proto=tcp,local_lock=none,addr=10.0.0.5
    42 22 0:42 / /mnt/flock rw,relatime - nfs4 srv:/f rw,vers=4.1,local_lock=flock
    43 22 0:43 / /mnt/posix rw,relatime - nfs srv:/p rw,vers=3,local_lock=posix
    44 22 0:44 /sub /mnt/with\040space rw - nfs4 srv:/s\040p rw,vers=4.2,local_lock=all
    45 41 0:45 / /mnt/nfs4/inner rw - ext4 /dev/vdb rw
    46 22 0:46 / /mnt/lustre rw - lustre mgs@tcp:/fs rw,localflock
    garbage line without a separator
    """
)


def test_parse_mountinfo_fields_and_escapes():
    mounts = parse_mountinfo(MOUNTINFO)
    assert len(mounts) == 9
    nfs3 = mounts[2]
    assert (nfs3.mount_point, nfs3.fstype, nfs3.source) == ("/mnt/nfs3", "nfs", "srv:/export")
    assert "nolock" in nfs3.super_options and "rw" in nfs3.mount_options
    spaced = mounts[6]
    assert spaced.mount_point == "/mnt/with space"
    assert spaced.source == "srv:/s p"
    assert spaced.root == "/sub"


def test_find_mount_picks_the_longest_prefix():
    mounts = parse_mountinfo(MOUNTINFO)
    assert find_mount(mounts, "/mnt/nfs4/job/store").mount_point == "/mnt/nfs4"
    assert find_mount(mounts, "/mnt/nfs4/inner/store").mount_point == "/mnt/nfs4/inner"
    assert find_mount(mounts, "/mnt/nfs4x/store").mount_point == "/"
    assert find_mount(mounts, "/dev/shm").mount_point == "/dev/shm"
    assert find_mount(mounts, "/mnt/with space/s").fstype == "nfs4"


@pytest.mark.parametrize(
    "where, bad",
    [
        ("/mnt/nfs3", "nolock"),
        ("/mnt/flock", "local_lock=flock"),
        ("/mnt/with space", "local_lock=all"),
        ("/mnt/lustre", "localflock"),
        ("/mnt/nfs4", None),
        ("/mnt/posix", None),  # only fcntl locks are local; flock goes to the server
        ("/", None),
        ("/dev/shm", None),
    ],
)
def test_lock_problem_by_mount_options(where, bad):
    mount = find_mount(parse_mountinfo(MOUNTINFO), where + "/f")
    problem = lock_problem(mount)
    if bad is None:
        assert problem is None
    else:
        assert f"'{bad}'" in problem


def test_store_on_a_nolock_nfs_mount_is_refused_naming_the_mount(tmp_path):
    table = tmp_path / "mountinfo"
    table.write_text(MOUNTINFO)
    with pytest.raises(DistStoreError) as info:
        check_mount("/mnt/nfs3/job/store", str(table))
    text = str(info.value)
    for part in ("/mnt/nfs3/job/store", "mount /mnt/nfs3", "srv:/export", "'nolock'", "lockd", "NFSv4"):
        assert part in text
    assert check_mount("/mnt/nfs4/job/store", str(table)).fstype == "nfs4"
    assert check_mount("/x", str(tmp_path / "missing")) is None  # unreadable table: no check


def test_constructor_runs_the_mount_check(path, monkeypatch):
    bad = MountInfo("/mnt/x", "/", "nfs", "srv:/x", ("rw",), ("vers=3", "nolock", "local_lock=all"))
    monkeypatch.setattr(file_mounts, "mount_of", lambda p, *a: bad)
    with pytest.raises(DistStoreError, match="mount /mnt/x .*'nolock'"):
        FileStore(path)
    assert not os.path.exists(path)  # refused before creating anything


# -- file_log ------------------------------------------------------------------------------------


def test_file_log_encode_and_replay():
    data = file_log.encode_records([(b"/a", b"1"), (b"/b", b"2"), (b"-/a", b""), (b"refcount/", b"1")])
    cache = {}
    assert file_log.replay(data, cache) == len(data)
    assert cache == {b"/b": b"2", b"refcount/": b"1"}
    assert file_log.encode_record(b"/a", b"hello") == bytes.fromhex("020000002f610500000068656c6c6f")
    assert [k for _, k, _ in file_log.iter_records(data)] == [b"/a", b"/b", b"-/a", b"refcount/"]
    assert file_log.load(data) == cache
    assert file_log.user_key("k") == b"/k" and file_log.tombstone_key(b"/k") == b"-/k"


@pytest.mark.parametrize("cut", range(1, 15))
def test_file_log_replay_stops_before_a_partial_record(cut):
    whole = file_log.encode_record(b"/a", b"1")
    second = file_log.encode_record(b"/bb", b"hello")
    data = whole + second[:cut]
    cache = {}
    assert file_log.replay(data, cache) == len(whole)
    assert cache == {b"/a": b"1"}
    assert file_log.record_end(data) == len(whole)
    assert file_log.describe_damage(data, len(whole))
    # the rest arrives: replay continues where it stopped
    data += second[cut:]
    assert file_log.replay(data, cache, len(whole)) == len(data)
    assert cache[b"/bb"] == b"hello"


def test_file_log_replay_region_bounds_and_buffer_types():
    data = file_log.encode_records([(b"/a", b"1"), (b"/b", b"2")])
    cache = {}
    first_end = len(file_log.encode_record(b"/a", b"1"))
    assert file_log.replay(data, cache, 0, first_end + 3) == first_end
    assert cache == {b"/a": b"1"}
    for buffer in (bytearray(data), memoryview(data)):
        cache = {}
        assert file_log.replay(buffer, cache, first_end) == len(data)
        assert cache == {b"/b": b"2"} and all(type(k) is bytes for k in cache)


def test_symlinked_path_shares_the_side_file(tmp_path):
    real_dir = tmp_path / "real"
    real_dir.mkdir()
    (tmp_path / "link").symlink_to(real_dir)
    with FileStore(str(real_dir / "s"), 2) as a, FileStore(str(tmp_path / "link" / "s"), 2) as b:
        b.set("k", "v")
        assert a.get("k") == b"v"
        assert sorted(os.listdir(real_dir)) == [
            "s",
            "s" + SIDECAR_SUFFIX,
        ]
        assert Path(str(real_dir / "s") + SIDECAR_SUFFIX).read_text() == "2\n"
    assert os.listdir(real_dir) == []


def test_the_process_record_of_a_store_file_goes_with_its_last_store(tmp_path):
    """Issue 37: the record a process keeps per store file (its mutex and counts, ~250 B) stayed
    for the life of the process, one per path ever opened. It goes when the last store of this
    process on the file closes: by close(), by garbage collection, or when the join fails."""
    from distlib.store import file_io

    before = len(file_io._SHARED)
    for i in range(50):
        FileStore(str(tmp_path / f"s{i}"), 1).close()
    assert len(file_io._SHARED) == before, "records left behind by 50 closed stores"
    path = str(tmp_path / "two")
    first, second = FileStore(path), FileStore(path)
    first.close()
    assert len(file_io._SHARED) == before + 1  # the second store still uses it (and its mutex)
    second.set("k", "v")
    assert second.get("k") == b"v"
    second.close()
    assert len(file_io._SHARED) == before
    collected = FileStore(str(tmp_path / "collected"))
    del collected
    gc.collect()
    assert len(file_io._SHARED) == before, "a store closed by garbage collection left its record"
    with pytest.raises(DistStoreError, match="does not exist"):
        FileStore(str(tmp_path / "missing" / "store"))
    assert len(file_io._SHARED) == before, "a store whose join failed left its record"
