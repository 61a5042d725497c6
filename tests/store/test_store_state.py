"""KeyValueState (distlib/store/tcp/state.py) on its own: the TCP store's semantics with no
sockets, plus the ADD and compare_set rules every store shares (distlib/store/base.py)."""

from __future__ import annotations

import pytest

from distlib.store.base import add_to_counter, compare_set_refusal
from distlib.store.tcp.state import KeyValueState, StateError, Waiter

MAX_I64 = (1 << 63) - 1
MIN_I64 = -(1 << 63)


class Released:
    """Records the order in which the state releases waiters."""

    def __init__(self):
        self.order = []

    def __call__(self, waiter):
        self.order.append(waiter)


@pytest.fixture
def released():
    return Released()


@pytest.fixture
def state(released):
    return KeyValueState(released, max_value=16)


# -- the rules shared by every store ------------------------------------------------------------


@pytest.mark.parametrize("old, amount, expected", [
    (None, 5, 5),
    (b"41", 1, 42),
    (b"-7", 2, -5),
    (b" 12 ", 1, 13),  # strtoll: leading blanks, trailing garbage
    (b"5abc", 0, 5),
    (b"+3", 1, 4),
    (b"%d" % MAX_I64, 1, MIN_I64),  # wraps as torch's servers do
    (b"5", MAX_I64, MIN_I64 + 4),
    (b"%d" % (1 << 62), 1 << 62, MIN_I64),
])
def test_add_to_counter_follows_torchs_arithmetic(old, amount, expected):
    assert add_to_counter(old, amount, "k") == expected


def test_add_to_counter_names_the_key_of_a_value_that_is_no_number():
    with pytest.raises(ValueError, match=r"stoll: the value of key 'word' is not an integer"):
        add_to_counter(b"hello", 1, "word")
    with pytest.raises(ValueError, match=r"key '/k'"):
        add_to_counter(b"abc", 1, b"/k")  # stored keys are shown as text


@pytest.mark.parametrize("current, expected, desired, refused", [
    (None, b"", b"d", None),  # absent, expected empty: written
    (None, b"x", b"d", b"x"),  # absent, expected given: not written, expected returned
    (b"x", b"x", b"d", None),  # equal: written
    (b"", b"", b"d", None),  # an empty value equals an empty expected
    (b"y", b"x", b"d", b"y"),  # different: not written, current returned
])
def test_compare_set_has_torchs_four_cases(current, expected, desired, refused):
    assert compare_set_refusal(current, expected, desired) == refused


# -- values and waits ---------------------------------------------------------------------------


def test_a_set_releases_every_waiter_of_the_key_in_order(state, released):
    a, b, c = Waiter(), Waiter(), Waiter()
    assert state.wait(a, [b"k"]) is False
    assert state.wait(b, [b"k"]) is False
    assert state.wait(c, [b"other"]) is False
    state.set(b"k", b"v")
    assert released.order == [a, b]
    assert (a.wait_count, a.wait_keys, b.wait_count) == (0, (), 0)
    assert c.wait_count == 1 and b"k" not in state.waiters


def test_a_wait_on_present_keys_returns_at_once_and_registers_nothing(state):
    state.set(b"k", b"v")
    waiter = Waiter()
    assert state.wait(waiter, [b"k"]) is True
    assert state.wait(waiter, []) is True
    assert waiter.wait_count == 0 and not state.waiters


def test_a_multi_key_wait_counts_each_missing_key(state, released):
    state.set(b"a", b"1")
    waiter = Waiter()
    assert state.wait(waiter, [b"a", b"b", b"c", b"c"]) is False
    assert waiter.wait_count == 3  # a key listed twice counts twice, as torch
    state.set(b"b", b"1")
    assert released.order == []
    state.set(b"c", b"1")
    assert released.order == [waiter]


def test_cancel_forgets_every_wait(state, released):
    waiter = Waiter()
    state.wait(waiter, [b"x", b"y"])
    state.cancel(waiter)
    assert waiter.wait_count == 0 and not state.waiters
    state.set(b"x", b"1")
    state.set(b"y", b"1")
    assert released.order == []


def test_a_closed_waiter_is_never_released(state, released):
    waiter = Waiter()
    state.wait(waiter, [b"k"])
    waiter.closed = True
    state.set(b"k", b"v")
    assert released.order == []


def test_check_and_num_keys(state):
    assert state.check([]) is True
    assert state.check([b"k"]) is False
    state.set(b"k", b"v")
    state.queue_push(b"q", b"1")
    assert state.check([b"k", b"q"]) is True  # a non-empty queue counts, as libuv
    assert state.num_keys() == 1  # queues do not


def test_delete_says_whether_the_key_was_there_and_leaves_waiters_alone(state, released):
    state.set(b"k", b"v")
    assert state.delete(b"k") is True
    assert state.delete(b"k") is False
    waiter = Waiter()
    state.wait(waiter, [b"k"])
    assert state.delete(b"k") is False
    assert waiter.wait_count == 1 and released.order == []
    state.set(b"k", b"again")
    assert released.order == [waiter]


def test_append_creates_extends_and_refuses_past_the_limit(state, released):
    waiter = Waiter()
    state.wait(waiter, [b"k"])
    state.append(b"k", b"po")
    assert released.order == [waiter]
    state.append(b"k", b"tato")
    assert state.data[b"k"] == b"potato"
    with pytest.raises(StateError, match=r"APPEND to key k would make a value of 17 bytes, over the limit of 16"):
        state.append(b"k", b"x" * 11)
    assert state.data[b"k"] == b"potato"


def test_multi_set_writes_in_order_and_wakes_each_key(state, released):
    waiter = Waiter()
    state.wait(waiter, [b"a", b"b"])
    state.multi_set([(b"a", b"1"), (b"b", b"2"), (b"a", b"3")])
    assert state.data == {b"a": b"3", b"b": b"2"}
    assert released.order == [waiter]


# -- compare_set and counters -------------------------------------------------------------------


def test_compare_set_wakes_waiters_only_when_it_writes(state, released):
    waiter = Waiter()
    state.wait(waiter, [b"k"])
    assert state.compare_set(b"k", b"x", b"y") == b"x"  # absent, expected given: nothing
    assert released.order == [] and b"k" not in state.data
    assert state.compare_set(b"k", b"", b"first") == b"first"
    assert released.order == [waiter]
    assert state.compare_set(b"k", b"nope", b"second") == b"first"
    assert state.compare_set(b"k", b"first", b"second") == b"second"


def test_add_stores_decimal_ascii_and_wakes(state, released):
    waiter = Waiter()
    state.wait(waiter, [b"n"])
    assert state.add(b"n", 5) == 5
    assert state.data[b"n"] == b"5" and released.order == [waiter]
    assert state.add(b"n", -7) == -2
    assert state.data[b"n"] == b"-2"


def test_add_on_a_value_that_is_no_number_is_refused_and_changes_nothing(state):
    state.set(b"text", b"hello")
    with pytest.raises(StateError, match=r"^ADD on key text: stoll: the value of key 'text' is not an integer"):
        state.add(b"text", 1)
    assert state.data[b"text"] == b"hello"
    with pytest.raises(StateError, match=r"^BARRIER on key text"):
        state.barrier(Waiter(), b"text", 2)


def test_add_many_returns_what_each_add_would_and_stores_once(state, released):
    state.set(b"n", b"%d" % (MAX_I64 - 1))
    one_by_one = KeyValueState(Released())
    one_by_one.set(b"n", b"%d" % (MAX_I64 - 1))
    deltas = [1, 1, 5, -3]
    waiter = Waiter()
    state.wait(waiter, [b"m"])
    assert state.add_many(b"n", deltas) == [one_by_one.add(b"n", d) for d in deltas]
    assert state.data[b"n"] == one_by_one.data[b"n"]
    assert state.add_many(b"m", [2, 3]) == [2, 5]
    assert released.order == [waiter]  # one wake-up for the whole run


def test_counter_reads_without_writing(state):
    assert state.counter(b"absent") == 0 and b"absent" not in state.data
    state.set(b"n", b" 12 ")
    assert state.counter(b"n") == 12
    state.set(b"bad", b"x")
    with pytest.raises(StateError):
        state.counter(b"bad")


# -- queues --------------------------------------------------------------------------------------


def test_queues_are_fifo_and_a_push_releases_one_waiter(state, released):
    first, second = Waiter(), Waiter()
    state.wait(first, [b"q"])
    state.wait(second, [b"q"])
    state.queue_push(b"q", b"1")
    assert released.order == [first]
    state.queue_push(b"q", b"2")
    assert released.order == [first, second]
    assert state.queue_len(b"q") == 2
    assert state.queue_pop(b"q") == (2, b"1")
    assert state.queue_pop(b"q") == (1, b"2")
    assert state.queue_pop(b"q") == (0, None)
    assert state.queue_len(b"q") == 0 and b"q" not in state.queues


def test_a_queue_and_a_key_of_one_name_coexist(state):
    state.set(b"x", b"value")
    state.queue_push(b"x", b"item")
    assert state.data[b"x"] == b"value" and state.queue_pop(b"x") == (1, b"item")


# -- barrier -------------------------------------------------------------------------------------


def test_a_barrier_releases_its_participants_when_it_fills(state, released):
    a, b, c = Waiter(), Waiter(), Waiter()
    plain = Waiter()
    state.wait(plain, [b"bar"])
    assert state.barrier(a, b"bar", 3) is False
    assert released.order == [plain]  # the key exists now: plain waits end, not the barrier
    assert state.barrier(b, b"bar", 3) is False
    assert (a.wait_count, a.barrier_key) == (1, b"bar")
    assert state.barrier(c, b"bar", 3) is True  # the last one is answered by the caller
    assert released.order == [plain, a, b]
    assert state.data[b"bar"] == b"3" and not state.barrier_waiters
    assert state.barrier(Waiter(), b"bar", 3) is True  # a later arrival passes at once
    assert state.data[b"bar"] == b"4"


def test_a_cancelled_barrier_participant_is_not_released_and_the_count_stays(state, released):
    a, b = Waiter(), Waiter()
    state.barrier(a, b"bar", 3)
    state.cancel(a)
    assert state.barrier(b, b"bar", 3) is False
    assert state.data[b"bar"] == b"2"  # torch does not take a cancelled arrival back
    assert state.barrier(Waiter(), b"bar", 3) is True
    assert released.order == [b]


# -- what waits cost (issue 28) ------------------------------------------------------------------


@pytest.mark.parametrize("waiters, keys", [(1, 20_000), (200, 100)], ids=["distinct keys", "shared keys"])
def test_the_charge_of_waits_covers_what_they_allocate(waiters, keys):
    """``wait_bytes`` against tracemalloc: WAITs decoded from requests (as the server does)
    on keys nobody waited for, and many WAITs on the same keys (a job's ranks waiting for each
    other's records). The charge is at least what is allocated and at most 1.6 times it."""
    import gc
    import tracemalloc

    from distlib.store.tcp import codec

    state = KeyValueState(lambda w: None, max_wait_keys=keys)
    requests = [codec.keys_request(codec.Op.WAIT, [b"job/rank/%08d" % i for i in range(keys)]) for _ in range(waiters)]
    held = []
    gc.collect()
    tracemalloc.start()
    try:
        for request in requests:
            decoded, _ = codec.read_keys(request, 1, len(request), codec.Limits())
            waiter = Waiter()
            assert not state.wait(waiter, decoded)
            held.append(waiter)
        del decoded
        gc.collect()
        allocated = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert allocated <= state.wait_bytes <= 1.6 * allocated, (allocated, state.wait_bytes)
    for waiter in held:
        state.cancel(waiter)
    assert state.wait_bytes == 0 and not state.waiters


def test_a_wait_is_charged_until_its_last_key_arrives(state, released):
    w = Waiter()
    assert not state.wait(w, [b"a", b"b"])
    charged = state.wait_bytes
    assert charged == state.cost_of(w) + 2 * 128 > 0  # (+ the two keys' entries)
    state.set(b"a", b"1")
    assert state.wait_bytes == charged - (1 + 56 + 128)  # a's registration is given back; still waiting for b
    state.set(b"b", b"2")
    assert released.order == [w] and state.wait_bytes == 0 and state.cost_of(w) == 0


def test_barriers_and_queue_waits_are_charged_and_released(state, released):
    first, second = Waiter(), Waiter()
    assert not state.barrier(first, b"bar", 2)
    assert state.wait_bytes == len(b"bar") + 56 + 128 and state.cost_of(first) == len(b"bar") + 56
    assert state.barrier(second, b"bar", 2)
    assert state.wait_bytes == 0
    popper = Waiter()
    assert not state.wait(popper, [b"q"])
    state.queue_push(b"q", b"x")
    assert released.order == [first, popper] and state.wait_bytes == 0


def test_waits_over_the_caps_are_refused_and_charge_nothing(released):
    state = KeyValueState(released, max_wait_keys=3, max_waiting_keys=4)
    with pytest.raises(StateError, match=r"WAIT on 4 keys: one client may wait for at most 3 keys at once"):
        state.wait(Waiter(), [b"a", b"b", b"c", b"d"])
    assert state.wait(Waiter(), [b"a", b"b"]) is False
    with pytest.raises(StateError, match=r"WAIT on 3 more missing keys: the server already waits for 2 distinct"):
        state.wait(Waiter(), [b"c", b"d", b"e"])
    assert state.wait(Waiter(), [b"a", b"b", b"c"]) is False  # two of them are waited for already: one new
    assert len(state.waiters) == 3


def test_cancelled_and_partly_released_waits_give_back_exactly_what_they_took(released):
    """Registrations on shared keys, a key listed twice, a queue push, a cancel after part of a
    wait was released: at the end nothing is charged."""
    state = KeyValueState(released)
    a, b, c = Waiter(), Waiter(), Waiter()
    state.wait(a, [b"x", b"y", b"x"])
    state.wait(b, [b"y", b"z"])
    state.wait(c, [b"q"])
    state.set(b"y", b"1")  # a and b each lose one registration; y's entry goes
    state.cancel(a)
    state.queue_push(b"q", b"v")  # releases c
    assert released.order == [c]
    state.cancel(b)
    assert state.wait_bytes == 0 and not state.waiters
