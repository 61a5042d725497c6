"""The Store API semantics every store shares (torch.distributed.Store), one suite for all.

Store-specific behaviour (FileStore's file bytes, TCPStore's wire bytes, ...)
lives in the per-store test modules.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest

from distlib import DistError, DistStoreError, QueueEmptyError


def test_set_get_roundtrip_str_and_bytes(store):
    store.set("k1", "v1")
    store.set("bin", b"\x00\x01\xff")
    store.set("empty", "")
    store.set("unicode", "héllo ✓")
    assert store.get("k1") == b"v1"
    assert store.get("bin") == b"\x00\x01\xff"
    assert store.get("empty") == b""
    assert store.get("unicode") == "héllo ✓".encode()
    assert isinstance(store.get("k1"), bytes)


def test_set_overwrites(store):
    store.set("k", "old")
    store.set("k", b"new")
    assert store.get("k") == b"new"


def test_add_counts_from_zero_and_stores_decimal(store):
    assert store.add("cnt", 5) == 5
    assert store.add("cnt", -2) == 3
    assert store.add("cnt", 0) == 3
    assert store.get("cnt") == b"3"
    assert store.add("neg", -7) == -7
    assert store.get("neg") == b"-7"


def test_add_on_a_set_counter_value(store):
    store.set("c", "41")
    assert store.add("c", 1) == 42


def test_compare_set_four_cases(store):
    # missing key, non-empty expected: nothing changes, expected comes back
    assert store.compare_set("cs", "x", "y") == b"x"
    assert not store.check(["cs"])
    # missing key, empty expected: sets it
    assert store.compare_set("cs", "", "first") == b"first"
    assert store.get("cs") == b"first"
    # present and matching: sets it
    assert store.compare_set("cs", "first", "second") == b"second"
    # present and different: returns current, no change
    assert store.compare_set("cs", "nope", "third") == b"second"
    assert store.get("cs") == b"second"


def test_check(store):
    store.set("a", "1")
    assert store.check([]) is True
    assert store.check(["a"]) is True
    assert store.check(["a", "missing"]) is False


def test_wait_returns_for_present_keys(store):
    store.set("w1", "1")
    store.add("w2", 1)
    store.wait(["w1", "w2"])
    store.wait(["w1"], timedelta(seconds=1))


def test_wait_times_out_naming_keys_and_time(store):
    start = time.monotonic()
    with pytest.raises(DistStoreError) as info:
        store.wait(["never_set"], timedelta(seconds=0.3))
    elapsed = time.monotonic() - start
    assert 0.25 <= elapsed < 2.0
    text = str(info.value)
    assert "never_set" in text
    assert "300ms" in text
    assert isinstance(info.value, DistError) and isinstance(info.value, RuntimeError)


def test_zero_timeout_does_not_wait(store):
    start = time.monotonic()
    with pytest.raises(DistStoreError):
        store.wait(["nope"], timedelta(0))
    assert time.monotonic() - start < 1.0


def test_get_missing_key_times_out_within_store_timeout(store):
    store.set_timeout(timedelta(seconds=0.4))
    assert store.timeout == timedelta(seconds=0.4)
    start = time.monotonic()
    with pytest.raises(DistStoreError, match="missing_key"):
        store.get("missing_key")
    elapsed = time.monotonic() - start
    assert 0.35 <= elapsed < 2.0
    # the store is still usable after a timeout
    store.set("after", "ok")
    assert store.get("after") == b"ok"


def _set_later(store, key, value, delay):
    def run():
        time.sleep(delay)
        store.set(key, value)

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_get_blocks_until_another_client_sets(store):
    other = store.clone()
    thread = _set_later(other, "late", "v", 0.2)
    start = time.monotonic()
    assert store.get("late") == b"v"
    assert time.monotonic() - start >= 0.15
    thread.join(5)


def test_wait_woken_by_add_from_another_client(store):
    """torch's HashStore misses this wake-up (add does not notify); distlib does not."""
    other = store.clone()

    def run():
        time.sleep(0.2)
        other.add("added", 1)

    thread = threading.Thread(target=run)
    thread.start()
    start = time.monotonic()
    store.wait(["added"], timedelta(seconds=5))
    assert time.monotonic() - start < 3.0
    thread.join(5)


def test_delete_key(store):
    store.set("d", "1")
    assert store.delete_key("d") is True
    assert not store.check(["d"])
    # deleting a missing key: False in every distlib store (torch's FileStore: True always)
    assert store.delete_key("d") is False


def test_num_keys_follows_sets_and_deletes(store):
    base = store.num_keys()
    store.set("n1", "1")
    store.set("n2", "2")
    store.add("n3", 1)
    assert store.num_keys() == base + 3
    store.delete_key("n2")
    assert store.num_keys() == base + 2


def test_append_creates_and_extends(store):
    store.append("ap", "po")
    store.append("ap", "tato")
    assert store.get("ap") == b"potato"


def test_multi_set_multi_get(store):
    store.multi_set(["m1", "m2", "m3"], ["a", b"b", ""])
    assert store.multi_get(["m1", "m2", "m3"]) == [b"a", b"b", b""]
    assert store.multi_get([]) == []


def test_multi_set_length_mismatch(store):
    with pytest.raises(DistStoreError, match="same size"):
        store.multi_set(["a", "b"], ["1"])
    assert not store.check(["a"])


def test_multi_get_times_out_naming_missing_key(store):
    store.set("here", "1")
    store.set_timeout(timedelta(seconds=0.3))
    with pytest.raises(DistStoreError, match="gone"):
        store.multi_get(["here", "gone"])


def test_list_keys_contains_user_keys(store):
    store.set("lk1", "1")
    store.add("lk2", 1)
    keys = store.list_keys()
    assert "lk1" in keys and "lk2" in keys


def test_clone_sees_writes(store):
    other = store.clone()
    store.set("shared", "yes")
    assert other.get("shared") == b"yes"
    other.set("back", "1")
    assert store.get("back") == b"1"


def test_barrier_releases_all_participants(store):
    clones = [store.clone() for _ in range(3)]
    errors = []

    def run(s):
        try:
            s.barrier("bar", 3, timedelta(seconds=10))
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(c,)) for c in clones]
    for t in threads:
        t.start()
    for t in threads:
        t.join(15)
    assert not errors
    assert not any(t.is_alive() for t in threads)


def test_barrier_times_out_when_short_of_participants(store):
    with pytest.raises(DistStoreError, match="timeout"):
        store.barrier("lonely", 2, timedelta(seconds=0.3))


def test_keys_must_be_str_and_values_str_or_bytes(store):
    with pytest.raises(TypeError, match="key"):
        store.set(b"bytes-key", "v")
    with pytest.raises(TypeError, match="value"):
        store.set("k", 12)
    with pytest.raises(TypeError):
        store.check("not-a-list")
    for keys in ([b"bytes-key"], [7], ["k", b"bytes-key"]):  # one-key lists have a fast path
        with pytest.raises(TypeError, match="key"):
            store.check(keys)
        with pytest.raises(TypeError, match="key"):
            store.wait(keys, timedelta(seconds=0.1))


def test_timeout_accepts_timedelta_and_seconds(store):
    store.set_timeout(timedelta(seconds=7))
    assert store.timeout == timedelta(seconds=7)
    store.set_timeout(1.5)
    assert store.timeout == timedelta(seconds=1.5)
    with pytest.raises(ValueError, match="negative"):
        store.set_timeout(-1)


# -- queues: HashStore and TCPStore have them (FileStore raises, as in torch: see
# test_file_store.py) ------------------------------------------------------------------------


@pytest.fixture(params=["hash", "tcp", "tcp-prefix"])
def queue_store(request, tmp_path):
    from .conftest import make_store

    store, owned = make_store(request.param, tmp_path)
    yield store
    for obj in owned:
        obj.close()


def test_queues_fifo(queue_store):
    store = queue_store
    assert store.queue_len("q") == 0
    store.queue_push("q", "1")
    store.queue_push("q", b"2")
    assert store.check(["q"])
    assert store.queue_len("q") == 2
    store.wait(["q"])
    assert store.queue_pop("q") == b"1"
    assert store.queue_pop("q", block=False) == b"2"
    with pytest.raises(QueueEmptyError, match="empty"):
        store.queue_pop("q", block=False)


def test_blocking_queue_pop_times_out(queue_store):
    queue_store.set_timeout(timedelta(seconds=0.3))
    with pytest.raises(DistStoreError, match="timeout"):
        queue_store.queue_pop("empty_queue")


def test_blocking_queue_pop_woken_by_push(queue_store):
    other = queue_store.clone()

    def run():
        time.sleep(0.2)
        other.queue_push("jobs", "work")

    thread = threading.Thread(target=run)
    thread.start()
    assert queue_store.queue_pop("jobs") == b"work"
    thread.join(5)


def test_nested_prefix_stores_describe_themselves_as_one_prefix():
    """Errors name where a store's keys live: the base store and the one prefix they carry."""
    from distlib.store import HashStore, PrefixStore

    base = HashStore()
    nested = PrefixStore("cpu/", PrefixStore("default_pg", PrefixStore("distlib/run/a", base)))
    nested.set("k", "v")
    assert base.get("distlib/run/a/default_pg/cpu//k") == b"v"
    assert nested.describe() == f"{base.describe()}, keys under 'distlib/run/a/default_pg/cpu//'"
