"""FileStore on files that are damaged, shrink, yield endless data or refuse I/O.

Each case is a real file (or device, pipe, directory, read-only or full mount) and the
error a user gets: a DistStoreError that names the file, what was being done, the byte
offset or the errno, and what to do. Permission cases run the store in a child process as
an unprivileged user when the tests run as root (root bypasses file modes); read-only and
full mounts are made in a user and mount namespace (``unshare``), which works for root and
for other users alike, and skip only where the kernel refuses such namespaces.
"""

from __future__ import annotations

import os
import shutil
import stat
import struct
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import tracemalloc
from datetime import timedelta
from pathlib import Path

import pytest

from distlib import DistStoreError
from distlib.store import file_io, file_log
from distlib.store.file import SIDECAR_SUFFIX, FileStore
from distlib.store.file_locks import LOCK_SH, lock, unlock_close

ROOT = Path(__file__).resolve().parents[2]
NOBODY = 65534


def rec(key: bytes, value: bytes) -> bytes:
    return struct.pack("<I", len(key)) + key + struct.pack("<I", len(value)) + value


@pytest.fixture
def path(tmp_path):
    return str(tmp_path / "store")


# -- damage: zeros, empty keys, length fields beyond the limits ------------------------------------


def test_zeros_appended_to_a_live_file_are_damage_naming_the_offset(path):
    with FileStore(path) as store:
        store.set("a", "1")
        end = os.path.getsize(path)
        with open(path, "ab") as f:
            f.write(bytes(8))  # what a naive reader takes for a record of an empty key
        with pytest.raises(DistStoreError) as info:
            store.get("a")
        text = str(info.value)
        assert f"store file {path} is damaged at byte {end}: zero bytes where a record should start" in text
        with pytest.raises(DistStoreError, match=f"damaged at byte {end}"):
            store.set("b", "2")  # never appends after damage
        assert os.path.getsize(path) == end + 8
        os.truncate(path, end)  # repaired: the store goes on
        assert store.get("a") == b"1"


def test_a_file_of_zeros_is_refused_at_open(path):
    Path(path).write_bytes(bytes(4096))  # a preallocated or sparse file
    with pytest.raises(DistStoreError, match="damaged at byte 0: zero bytes"):
        FileStore(path)
    assert os.path.getsize(path) == 4096  # nothing appended


def test_an_empty_key_with_a_value_is_damage(path):
    Path(path).write_bytes(rec(b"/a", b"1") + struct.pack("<I", 0) + struct.pack("<I", 3) + b"abc")
    with pytest.raises(DistStoreError) as info:
        FileStore(path)
    assert "damaged at byte 11: a record with an empty key, which no FileStore writes" in str(info.value)


def test_the_empty_user_key_is_the_file_key_slash_and_round_trips(path):
    """torch 2.13 writes set("") as the key "/" (checked in the interop tests): not damage."""
    with FileStore(path) as store:
        store.set("", "v")
        assert store.get("") == b"v"
        assert Path(path).read_bytes().endswith(rec(b"/", b"v"))
        assert store.delete_key("") is True
    with FileStore(path) as again:  # a new reader replays it all
        assert not again.check([""])


@pytest.mark.parametrize(
    "record, what",
    [
        (struct.pack("<I", file_log.MAX_KEY + 1) + b"/k", f"announces a {file_log.MAX_KEY + 1}-byte key, beyond"),
        (rec(b"/k", b"")[:-4] + struct.pack("<I", 2**32 - 1), f"announces a {2**32 - 1}-byte value, beyond"),
    ],
)
def test_length_fields_beyond_the_limits_are_damage_at_once(path, record, what):
    Path(path).write_bytes(rec(b"/a", b"1") + record + b"x" * 100)
    with pytest.raises(DistStoreError) as info:
        FileStore(path)
    assert f"damaged at byte 11: a record {what}" in str(info.value)


def test_writers_refuse_records_a_reader_would_call_damage(path, monkeypatch):
    with FileStore(path) as store:
        size = os.path.getsize(path)
        with pytest.raises(ValueError, match="refused to write a 70000-byte key"):
            store.set("k" * 70000, "v")
        with pytest.raises(ValueError, match="refused"):
            store.add("k" * 70000, 1)
        monkeypatch.setattr(file_io, "_MAX_VALUE", 100)  # 256 MiB for real: not in a unit test
        with pytest.raises(ValueError, match="101-byte value"):
            store.set("big", b"x" * 101)
        with pytest.raises(ValueError, match="101-byte value"):
            store.compare_set("big", "", b"x" * 101)
        assert os.path.getsize(path) == size  # nothing written
        store.set("big", b"x" * 100)
        assert store.get("big") == b"x" * 100


# -- endless data: devices, pipes, a reader fed /dev/zero -----------------------------------------


@pytest.mark.parametrize("device", ["/dev/full", "/dev/zero", "/dev/null"])
def test_a_device_as_the_path_is_refused(device):
    if not os.path.exists(device):
        pytest.skip(f"{device} does not exist here")
    start = time.monotonic()
    with pytest.raises(DistStoreError) as info:
        FileStore(device)
    assert time.monotonic() - start < 5
    assert f"FileStore: {device} is a character device, not a regular file" in str(info.value)


@pytest.mark.timeout(20)
def test_a_named_pipe_as_the_path_is_refused_without_blocking(tmp_path):
    fifo = str(tmp_path / "pipe")
    os.mkfifo(fifo)
    with pytest.raises(DistStoreError, match="is a named pipe \\(FIFO\\), not a regular file"):
        FileStore(fifo)


def _read_with(log: file_io.LogFile, device: str) -> str:
    """What an operation's read gives when the path yields ``device``'s bytes."""
    fd = os.open(device, os.O_RDONLY)
    try:
        lock(fd, LOCK_SH, device, 5.0)
        with pytest.raises(DistStoreError) as info:
            log.catch_up(fd)
    finally:
        unlock_close(fd)
    return str(info.value)


@pytest.mark.parametrize("device", ["/dev/zero", "/dev/urandom"])
def test_a_reader_fed_endless_data_stops_at_the_first_bad_record_with_bounded_memory(tmp_path, device):
    """The reader itself (not only the constructor's regular-file check) never reads an
    endless source to its end: zeros are damage at byte 0, and noise has length fields no
    record has; reads grow only as data arrives."""
    log = file_io.LogFile(str(tmp_path / "store"), -1, 5.0)
    tracemalloc.start()
    try:
        text = _read_with(log, device)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert "is damaged at byte" in text
    if device == "/dev/zero":
        assert "damaged at byte 0: zero bytes" in text
    assert peak < 8 * 1024 * 1024, peak


def test_a_record_announcing_a_big_value_in_a_small_file_is_read_in_small_pieces(path):
    big = file_log.MAX_VALUE  # within the limit: could be real, so it is read, not refused
    Path(path).write_bytes(rec(b"/a", b"1") + rec(b"/big", b"")[:-4] + struct.pack("<I", big) + b"x" * 50)
    tracemalloc.start()
    try:
        with pytest.raises(DistStoreError) as info:
            FileStore(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert f"damaged at byte 11: a record announces a {big}-byte value but only 50 byte(s) follow" in str(info.value)
    assert peak < 4 * 1024 * 1024, peak  # not the 256 MiB the field announces


# -- files truncated or rewritten under a reader --------------------------------------------------


def test_a_file_truncated_under_a_reader_is_named_not_waited_on(path):
    with FileStore(path) as store:
        store.set("a", "1")
        store.set("b", "2")
        size = os.path.getsize(path)
        os.truncate(path, 5)  # another job took the path over
        store.set_timeout(timedelta(seconds=30))
        start = time.monotonic()
        with pytest.raises(DistStoreError) as info:
            store.get("never-set")
        assert time.monotonic() - start < 5
        assert (f"store file {path} was truncated from {size} to 5 bytes under us: another job "
                f"reused this file?") in str(info.value)
        with pytest.raises(DistStoreError, match="truncated from"):
            store.set("c", "3")
        assert os.path.getsize(path) == 5  # nothing appended to the other job's file
        os.unlink(path)


def test_a_waiter_sees_the_truncation_while_it_waits(path):
    store = FileStore(path)
    store.set("a", "1")
    store.set_timeout(timedelta(seconds=30))
    timer = threading.Timer(0.2, os.truncate, [path, 0])
    timer.start()
    start = time.monotonic()
    with pytest.raises(DistStoreError, match="truncated from .* to 0 bytes under us"):
        store.get("never-set")
    assert time.monotonic() - start < 5
    timer.join()
    os.unlink(path)
    store.close()


def test_a_file_rewritten_in_place_under_a_reader_is_named(path):
    """Another job's records where ours were (same length, other bytes): not misread."""
    with FileStore(path) as store:
        store.set("a", "1")
        data = Path(path).read_bytes()
        with open(path, "r+b") as f:  # same file, same size, its last record changed
            f.write(data[:-1] + b"9")
        with open(path, "ab") as f:
            f.write(rec(b"/b", b"2"))
        with pytest.raises(DistStoreError, match="was rewritten under us.*another job reused this file"):
            store.get("b")
        os.unlink(path)


# -- OS errors: a directory, permissions, a read-only or full file system --------------------------


def test_a_directory_as_the_path_names_it_and_the_fix(tmp_path):
    with pytest.raises(DistStoreError) as info:
        FileStore(str(tmp_path))
    text = str(info.value)
    assert f"opening (for writing, creating it if missing) store file {tmp_path} failed with EISDIR" in text
    assert f"is a directory; FileStore needs the path of a file (for example {tmp_path / 'store'})" in text
    assert os.listdir(tmp_path) == []


def test_a_path_through_a_file_names_enotdir(tmp_path):
    (tmp_path / "plain").write_text("x")
    with pytest.raises(DistStoreError, match="failed with ENOTDIR .*is a file, not a directory"):
        FileStore(str(tmp_path / "plain" / "store"))


def _open_as(target: str, user) -> str:
    """Open a FileStore on ``target`` in a forked child running as ``user`` (None: as we
    are); the DistStoreError's text, or "no error". Forked, not executed: the unprivileged
    user need not be able to reach this interpreter or checkout."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: drop privileges, try, report, leave without cleanup
        code = 0
        try:
            os.close(read_end)
            if user is not None:
                os.setgroups([])
                os.setresgid(user, user, user)
                os.setresuid(user, user, user)
            try:
                FileStore(target).set("k", "v")
                text = "no error"
            except DistStoreError as exc:
                text = f"DistStoreError: {exc}"
            os.write(write_end, text.encode())
        except BaseException as exc:  # anything else: the parent's assertion shows it
            os.write(write_end, f"unexpected {type(exc).__name__}: {exc}".encode())
            code = 1
        finally:
            os._exit(code)
    os.close(write_end)
    chunks = []
    while True:
        chunk = os.read(read_end, 65536)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(read_end)
    _, status = os.waitpid(pid, 0)
    out = b"".join(chunks).decode()
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, out
    return out


@pytest.fixture
def unprivileged_dir(tmp_path):
    """A directory whose modes apply to the store's process: tmp_path when not root; as
    root, a fresh directory in the system temp dir (tmp_path's parents are private to root),
    used by a child running as nobody (root bypasses file modes)."""
    if os.geteuid() != 0:
        yield tmp_path, None
        return
    base = tempfile.mkdtemp(prefix="distlib-perm-")
    os.chmod(base, 0o755)
    try:
        yield Path(base), NOBODY
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_a_read_only_file_names_its_mode_and_owner(unprivileged_dir):
    folder, user = unprivileged_dir
    target = folder / "store"
    target.write_bytes(rec(b"refcount/", b"0"))
    os.chmod(target, 0o444)
    out = _open_as(str(target), user)
    uid = os.geteuid() if user is None else user
    assert f"store file {target} failed with EACCES (Permission denied)" in out
    assert f"The file (mode 0444, owner uid {os.geteuid()}) is not writable by uid {uid}" in out
    assert target.read_bytes() == rec(b"refcount/", b"0")


def test_a_read_only_directory_names_the_directory(unprivileged_dir):
    folder, user = unprivileged_dir
    sub = folder / "ro"
    sub.mkdir()
    os.chmod(sub, 0o555)
    out = _open_as(str(sub / "store"), user)
    uid = os.geteuid() if user is None else user
    assert "failed with EACCES (Permission denied)" in out
    assert f"The file does not exist and directory {sub} does not let uid {uid} create it" in out
    assert os.listdir(sub) == []


#: Run in a user+mount namespace: open the store on argv[1], set a value of argv[2] bytes.
_IN_NAMESPACE = textwrap.dedent(
    """
    import os, sys
    from distlib import DistStoreError
    from distlib.store.file import FileStore
    try:
        store = FileStore(sys.argv[1])
        size = os.path.getsize(sys.argv[1])
        try:
            store.set("k", b"x" * int(sys.argv[2]))
        finally:
            print("size kept:", os.path.getsize(sys.argv[1]) == size)
    except DistStoreError as exc:
        print("DistStoreError:", exc)
        if "store" in dir():
            store.set("small", "1")  # the store goes on once the write that failed is undone
            print("then:", store.get("small"))
    """
)


def _in_namespace(setup: str, target: str, value_bytes: int = 1) -> str:
    result = subprocess.run(
        ["unshare", "-rm", "sh", "-c", setup + ' && exec "$@"', "sh",
         sys.executable, "-c", _IN_NAMESPACE, target, str(value_bytes)],
        capture_output=True, text=True, timeout=60, cwd=str(ROOT),
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def _unshare_works() -> bool:
    try:
        return subprocess.run(["unshare", "-rm", "true"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


needs_namespaces = pytest.mark.skipif(
    shutil.which("unshare") is None or not _unshare_works(),
    reason="needs unshare and user+mount namespaces (refused by this kernel or sandbox)",
)


@needs_namespaces
def test_a_read_only_mount_names_the_mount(tmp_path):
    """A read-only bind mount refuses writes to root too (EROFS, not a mode check)."""
    folder = tmp_path / "shared"
    folder.mkdir()
    target = folder / "store"
    target.write_bytes(rec(b"refcount/", b"0"))
    out = _in_namespace(f"mount --bind {folder} {folder} && mount -o remount,bind,ro {folder}", str(target))
    assert f"store file {target} failed with EROFS (Read-only file system)" in out
    assert f"Mount {folder} (source " in out and "is read-only; every FileStore user appends" in out
    assert target.read_bytes() == rec(b"refcount/", b"0")


@needs_namespaces
def test_a_full_file_system_is_named_and_the_record_rolled_back(tmp_path):
    folder = tmp_path / "small"
    folder.mkdir()
    target = folder / "store"
    out = _in_namespace(f"mount -t tmpfs -o size=64k tmpfs {folder}", str(target), 200_000)
    assert f"appending a 200010-byte record (at byte 18) to store file {target} failed with ENOSPC" in out
    assert "is full, or this user's quota is used up" in out
    assert "size kept: True" in out and "then: b'1'" in out


def test_a_store_file_never_leaves_its_side_file_on_refused_paths(tmp_path):
    with pytest.raises(DistStoreError):
        FileStore(str(tmp_path))
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(DistStoreError):
        FileStore(str(fifo))
    assert sorted(os.listdir(tmp_path)) == ["pipe"]
    assert not os.path.exists(str(tmp_path) + SIDECAR_SUFFIX)
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
