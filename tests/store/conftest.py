"""Store fixtures: the same semantic tests run against every store kind."""

from __future__ import annotations

import os
from datetime import timedelta

import pytest

from distlib.store import HashStore, PrefixStore
from distlib.store.tcp import TCPStore

STORE_KINDS = ["hash", "file", "tcp", "tcp-prefix"]


def make_store(kind: str, tmp_path, timeout: float = 10.0):
    """A fresh store of ``kind`` plus a list of objects to close afterwards."""
    if kind == "hash":
        store = HashStore()
        store.set_timeout(timedelta(seconds=timeout))
        return store, []
    if kind == "file":
        from distlib.store.file import FileStore

        store = FileStore(os.path.join(str(tmp_path), "store"), -1)
        store.set_timeout(timedelta(seconds=timeout))
        return store, [store]
    if kind in ("tcp", "tcp-prefix"):
        master = TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=timeout), wait_for_workers=False)
        client = TCPStore("127.0.0.1", master.port, None, False, timedelta(seconds=timeout))
        store = PrefixStore("job", client) if kind == "tcp-prefix" else client
        return store, [client, master]
    raise ValueError(kind)


@pytest.fixture(params=STORE_KINDS)
def store_kind(request):
    return request.param


@pytest.fixture
def store(store_kind, tmp_path):
    store, owned = make_store(store_kind, tmp_path)
    yield store
    for obj in owned:
        obj.close()
