"""FileStore on a network file system whose server stops answering (distlib/store/file_guard.py).

The real thing (an NFS server stopped and restarted under VM clients) is in
tests/platforms/test_nfs_failures.py; here a LogFile call is made to block, as a system call
on a hard NFS mount blocks while its server is down, and the mount is a sample NFS one.
"""

from __future__ import annotations

import logging
import threading
import time

import pytest

from distlib.errors import DistStoreError
from distlib.store import file as file_module
from distlib.store import file_guard
from distlib.store.file import FileStore
from distlib.store.file_guard import GuardedLog, guard
from distlib.store.file_io import LogFile
from distlib.store.file_join import JoinedFile
from distlib.store.file_mounts import MountInfo

NFS = MountInfo("/mnt/shared", "/", "nfs4", "srv:/export", ("rw",), ("vers=4.2", "hard"))
EXT4 = MountInfo("/", "/", "ext4", "/dev/vda", ("rw",), ())


@pytest.fixture
def on_nfs(monkeypatch):
    """FileStores made in the test believe their file is on NFS (NFS above)."""
    monkeypatch.setattr(file_module, "check_mount", lambda path: NFS)
    monkeypatch.setattr(file_guard, "FIRST_WARNING_S", 0.1)
    monkeypatch.setattr(file_guard, "WARNING_EVERY_S", 0.2)


def test_local_files_are_not_wrapped(tmp_path):
    log_file = LogFile(str(tmp_path / "s"), -1, 30.0)
    assert guard(log_file, EXT4) is log_file
    assert guard(log_file, None) is log_file
    assert isinstance(guard(log_file, NFS), GuardedLog)
    with FileStore(str(tmp_path / "local")) as store:  # this host's tmp: no wrapper, no thread
        assert type(store._log) is JoinedFile


def test_a_store_on_nfs_works_through_its_helper_thread(tmp_path, on_nfs):
    path = str(tmp_path / "store")
    with FileStore(path, 2) as a, FileStore(path, 2) as b:
        assert isinstance(a._log, GuardedLog)
        a.set("k", "v")
        assert b.get("k") == b"v"
        assert [a.add("n", 1), b.add("n", 10)] == [1, 11]
        assert a.compare_set("c", "", "a") == b"a" and b.compare_set("c", "", "b") == b"a"
        a.set_timeout(60)
        assert a._log.lock_wait_s == 60  # written through to the LogFile
        assert b.delete_key("k") and not a.check(["k"])
        assert a.num_keys() == b.num_keys() == 3  # refcount/, n and c
    assert not (tmp_path / "store").exists()  # world_size 2: the second close removed it


def _block(monkeypatch, method: str) -> threading.Event:
    """LogFile.<method> blocks until the returned event is set, as a call on a dead server does."""
    release = threading.Event()
    real = getattr(LogFile, method)

    def blocked(self, *args):
        release.wait(60)
        return real(self, *args)

    monkeypatch.setattr(LogFile, method, blocked)
    return release


def test_a_call_the_server_does_not_answer_gives_up_at_the_bound_naming_the_server(tmp_path, on_nfs, monkeypatch,
                                                                                     caplog):
    store = FileStore(str(tmp_path / "store"))
    store._log.lock_wait_s = 0.6  # the bound: the store timeout, at least MIN_LOCK_WAIT_S (30 s)
    release = _block(monkeypatch, "set")
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="distlib.store.file"):
        with pytest.raises(DistStoreError) as info:
            store.set("k", "v")
    waited = time.monotonic() - started
    text = str(info.value)
    assert "set got no answer from the file system for 600ms" in text, text
    assert "NFS server srv:/export (mount /mnt/shared, nfs4)" in text and str(tmp_path / "store") in text, text
    assert 0.6 <= waited < 5, waited
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings and all("NFS server srv:/export" in w and "Still waiting" in w for w in warnings), warnings
    # while that call is still blocked, the store's next call fails at once, saying why
    started = time.monotonic()
    with pytest.raises(DistStoreError, match=r"get not started|lookup not started"):
        store.get("k")
    assert time.monotonic() - started < 0.5
    # the server answers: the blocked set completes, and the store works again
    release.set()
    deadline = time.monotonic() + 10
    while True:
        try:
            assert store.get("k") == b"v"
            break
        except DistStoreError:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    store.close()


def test_a_server_that_answers_in_time_costs_only_the_wait(tmp_path, on_nfs, monkeypatch, caplog):
    """A restart (down, then a grace period) shorter than the bound: the call completes, after
    warnings that name the server."""
    store = FileStore(str(tmp_path / "store"))
    release = _block(monkeypatch, "add")
    threading.Timer(0.5, release.set).start()
    with caplog.at_level(logging.WARNING, logger="distlib.store.file"):
        assert store.add("n", 5) == 5
    assert any("add has waited" in r.getMessage() and "srv:/export" in r.getMessage() for r in caplog.records)
    store.close()


def test_errors_of_the_call_reach_the_caller(tmp_path, on_nfs):
    store = FileStore(str(tmp_path / "store"))
    store.set("n", "not a number")
    with pytest.raises(ValueError, match="stoll"):
        store.add("n", 1)
    store.close()
