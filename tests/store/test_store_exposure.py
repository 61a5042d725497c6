"""Warnings where a store is open to others (distlib/exposure.py, issue 28): a store server on
every interface without a token; a FileStore path that another user controls; a symbolic link
planted in a world-writable directory, which FileStore does not follow."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time

import pytest

from distlib import exposure
from distlib.errors import DistStoreError
from distlib.store.file import FileStore
from tests.fixtures.ports import free_port

EXPOSURE_LOG = "distlib.exposure"
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="making files of another user needs root")
OTHER_UID = 4242


@pytest.fixture
def warnings(monkeypatch, caplog):
    monkeypatch.setattr(exposure, "_warned", set())
    caplog.set_level(logging.WARNING, EXPOSURE_LOG)
    return lambda: [r.getMessage() for r in caplog.records if r.name == EXPOSURE_LOG]


def public_dir(tmp_path, owner: int) -> str:
    d = tmp_path / "public"
    d.mkdir()
    os.chmod(d, 0o1777)  # as /tmp
    os.chown(d, owner, owner)
    return str(d)


def test_store_server_on_every_interface_without_a_token_says_what_to_do(tmp_path):
    port = free_port()
    log = tmp_path / "log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISTLIB_AUTH_TOKEN")}
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "distlib.cli", "store-server", "--host", "0.0.0.0",
                                 "--port", str(port)], stderr=out, env=env)
    try:
        deadline = time.monotonic() + 30
        while "listening on" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
    finally:
        proc.terminate()
        proc.wait(10)
    text = log.read_text()
    assert text.count("WARNING distlib.exposure: the store listens on port %d of every interface without a token: "
                      "anyone who reaches port %d of every interface can join and send objects that are unpickled: "
                      "set DISTLIB_AUTH_TOKEN_FILE" % (port, port)) == 1, text


@needs_root
def test_a_directory_of_another_user_that_everyone_may_write_is_a_warning(tmp_path, warnings):
    d = public_dir(tmp_path, OTHER_UID)
    path = os.path.join(d, "store")
    with FileStore(path, 1) as store:
        store.set("k", "v")
    with FileStore(path, 1):
        pass
    assert warnings() == [
        f"FileStore {path}: its directory {d} is owned by uid {OTHER_UID} and every user may write to it (mode 1777): "
        f"another user can create the store file first, as a file of theirs or a link, and write the job's "
        f"records; use a directory only the job's users can write (mktemp -d, or a shared directory with mode 0770)"]


@needs_root
def test_a_store_file_of_another_user_that_everyone_may_write_is_a_warning(tmp_path, warnings):
    path = tmp_path / "store"
    path.touch()
    os.chown(path, OTHER_UID, OTHER_UID)
    os.chmod(path, 0o666)
    with FileStore(str(path), -1) as store:
        store.set("k", "v")
    assert warnings() == [
        f"FileStore {path}: the store file is owned by uid {OTHER_UID} and every user may write to it (mode 0666): "
        f"anyone on this host can add or change the job's records (the addresses ranks connect to); remove it "
        f"and let the job create its own"]


def test_a_link_in_a_world_writable_directory_is_not_followed(tmp_path, warnings):
    d = public_dir(tmp_path, os.geteuid())
    victim = tmp_path / "victim"
    victim.write_bytes(b"")
    link = os.path.join(d, "store")
    os.symlink(victim, link)
    with pytest.raises(DistStoreError) as err:
        FileStore(link, -1)
    assert str(err.value) == (
        f"FileStore: {link} is a symbolic link in {d}, a directory every user may write to: it is not followed "
        f"(another user can plant one there to make this job write to a file of their choosing). Use a path in a "
        f"directory only the job's users can write, or the link's target itself")
    assert victim.read_bytes() == b""  # nothing was written through it
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    os.symlink(victim, private / "store")
    with FileStore(str(private / "store"), -1) as store:  # a link in a private directory: followed, as torch
        store.set("k", "v")
    assert victim.read_bytes()


def test_a_link_planted_after_the_join_is_not_followed_either(tmp_path):
    d = public_dir(tmp_path, os.geteuid())
    path = os.path.join(d, "store")
    store = FileStore(path, -1)
    store.set("k", "v")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_bytes(b"")
    os.rename(path, str(tmp_path / "moved"))
    os.symlink(elsewhere, path)
    with pytest.raises(DistStoreError, match="is a symbolic link in .* it is not followed"):
        store.set("k2", "v2")
    assert elsewhere.read_bytes() == b""
    os.unlink(path)
    os.rename(str(tmp_path / "moved"), path)
    store.close()
