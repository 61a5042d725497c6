"""Small collectives: the same-host shared-memory channel (both sides of its threshold, its
wait strategy, async order, a killed or silent rank, mismatches across the threshold) and
the TCP algorithms for small arrays (every algorithm x op x dtype, mismatches over TCP)."""

import threading
import time

import numpy as np
import pytest

from distlib.backends.gloo.sizes import small_slot_bytes
from distlib.backends.gloo.transport import shm_channel, shm_wait

from . import cases, small_cases
from .harness import WorkerPool, spawn
from tests.fixtures.ports import free_port

OPS = ["SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "AVG", "PREMUL_SUM"]
SMALL_SIZES = [0, 1, 7, 1003]


def _uses_channel(ws: int) -> bool:
    return ws > 1 and shm_channel.supported()


# -- the channel ------------------------------------------------------------------------------------


def test_groups_of_one_host_get_a_channel_with_a_wait_policy_from_the_machine(pool):
    facts = pool.run(small_cases.channel_facts)
    if not _uses_channel(pool.world_size):
        assert facts == [None] * pool.world_size
        return
    for f in facts:
        assert f["slot"] == small_slot_bytes(pool.world_size)
        assert shm_wait.WaitPolicy(f["spin"], f["yield"]) == shm_wait.decide(pool.world_size, f["cpus"])


@pytest.mark.parametrize("op_name", OPS)
def test_all_reduce_on_both_sides_of_the_threshold(pool, op_name):
    ws = pool.world_size
    slot = small_slot_bytes(ws)
    per_rank = pool.run(small_cases.all_reduce_at_threshold, op_name, cases.ALL_DTYPES, slot)
    for rank, rows in enumerate(per_rank):
        for dtype, n, ok, used, _ in rows:
            assert ok, f"rank {rank}: {op_name} of {n} x {dtype} differs from numpy"
            fits = n * np.dtype(dtype).itemsize <= slot
            assert used == (fits and _uses_channel(ws)), f"rank {rank}: {n} x {dtype} took the wrong path"
    digests = [[row[-1] for row in rows] for rows in per_rank]
    assert all(d == digests[0] for d in digests), "ranks hold different results"


@pytest.mark.parametrize("dtype", ["float32", "int64", "bool", "complex128", "float16"])
def test_every_collective_on_both_sides_of_the_threshold(pool, dtype):
    ws = pool.world_size
    slot = small_slot_bytes(ws)
    for rank, results in enumerate(pool.run(small_cases.every_collective_at_threshold, dtype, slot)):
        for name, runs in results.items():
            assert all(ok for ok, _ in runs), f"rank {rank}: {name} wrong: {runs}"
            if name == "barrier":
                assert runs == [(True, _uses_channel(ws))]
                continue
            fit, over = runs
            assert fit[1] == _uses_channel(ws) and over[1] is False, f"rank {rank}: {name} paths {runs}"


def test_async_operations_keep_their_order_among_sync_ones(pool):
    ws = pool.world_size
    for rank, r in enumerate(pool.run(small_cases.async_mixed_with_sync, small_slot_bytes(ws))):
        assert r == {"a": float(ws ** 2), "b": float(ws * (ws - 1)), "big": float(ws), "c": float(ws ** 2),
                     "gathered": [float(ws ** 2)] * ws, "works_done": True}, f"rank {rank}: {r}"


def test_sync_calls_run_in_the_callers_thread(pool):
    for no_thread, thread, value in pool.run(small_cases.sync_calls_start_no_thread):
        assert no_thread and thread and value > 0


@pytest.mark.parametrize("asleep", [False, True], ids=["running", "asleep"])
def test_a_killed_rank_is_named_by_the_ranks_waiting_for_it_in_shared_memory(asleep):
    ws, victim = 3, 1
    results = spawn(small_cases.killed_during_small_collectives, ws, free_port(), victim, asleep, timeout=120)
    for rank, (code, outcome) in enumerate(results):
        if rank == victim:
            assert code == -9, f"the victim should have died by SIGKILL, exit {code}"
            continue
        assert code == 0, f"rank {rank}: {code} {outcome}"
        status, (text, elapsed, channel) = outcome
        assert status == "ok" and channel == shm_channel.supported()
        assert f"rank {victim} (" in text and "closed the connection" in text, f"rank {rank}: {text}"
        assert elapsed < 30, f"rank {rank} needed {elapsed:.1f}s (group timeout 60s)"


def test_a_silent_rank_is_named_by_the_ranks_waiting_for_it_in_shared_memory(tmp_path):
    ws, silent = 3, 2
    results = spawn(small_cases.silent_rank_in_small_collective, ws, str(tmp_path / "s"), silent, timeout=120)
    for rank, (code, (status, (text, _elapsed, _channel))) in enumerate(results):
        assert status == "ok" and code == 0, (rank, code, text)
        if rank == silent:
            continue
        assert "timed out after 6.0s" in text and "through shared memory" in text, f"rank {rank}: {text}"
        assert f"Silent: rank {silent} (" in text, f"rank {rank}: {text}"
        silent_list = text.split("Silent: ", 1)[1].split(" — ", 1)[0]
        assert silent_list.count("rank ") == 1, f"rank {rank} names live ranks as silent: {text}"


@pytest.mark.parametrize("pool", [2, 3, 4], indirect=True, ids=lambda ws: f"ws{ws}")
@pytest.mark.parametrize("kind,needle", [
    ("sizes", "different sizes"),
    ("large_broadcast", "different collectives"),
    ("small_vs_large_first", "mismatched collective"),
])
def test_mismatch_across_the_threshold_raises_on_every_rank(pool, kind, needle):
    for rank, (outcome, elapsed, check) in enumerate(
            pool.run(small_cases.mismatch_across_the_threshold, kind, small_slot_bytes(pool.world_size))):
        assert "mismatched collective" in outcome and needle in outcome, f"rank {rank}: {outcome!r}"
        if shm_channel.supported():
            # rank 0 learns it from the others' announcements at once, not from a heartbeat
            # two seconds later ("rank K is waiting in ...")
            assert "is waiting in" not in outcome and "rank 0 is in" not in outcome, f"rank {rank}: {outcome!r}"
        assert elapsed < 10, f"rank {rank} took {elapsed:.1f}s to notice"
        assert check == pool.world_size


# -- sleeping in the kernel -------------------------------------------------------------------------

#: No spinning or yielding, and kernel sleeps of 20 s: a wake-up the writer fails to give costs
#: a waiter 20 s, and the rounds below would overrun the case's time limit.
BLOCKING = {"distlib.backends.gloo.transport.shm_wait.SPIN_S": 0.0, "distlib.backends.gloo.transport.shm_wait.YIELD_S": 0.0,
            "distlib.backends.gloo.transport.shm_wait.YIELD_CROWDED_S": 0.0, "distlib.backends.gloo.transport.shm_channel.BLOCK_SLICE_S": 20.0}


@pytest.fixture(scope="module", params=[2, 4], ids=lambda ws: f"ws{ws}")
def blocking_pool(request):
    pool = WorkerPool(request.param, constants=BLOCKING)
    yield pool
    pool.close()


def test_waiters_asleep_in_the_kernel_are_woken_by_every_write(blocking_pool):
    if not shm_channel.supported():
        pytest.skip("no shared-memory channel on this CPU")
    rounds = 300
    start = time.monotonic()
    results = blocking_pool.run(small_cases.random_waits_all_reduce, rounds, timeout=100)
    assert all(wrong == 0 for wrong, _ in results), results
    assert len({ex for _, ex in results}) == 1 and results[0][1] >= rounds
    assert time.monotonic() - start < 60, "waiters slept through their wake-ups"


def test_futex_wait_returns_when_woken_and_when_the_word_differs():
    import mmap

    futex = shm_wait.FUTEX
    if not futex.available:
        pytest.skip("no futex system call here")
    mm = mmap.mmap(-1, 4096)
    words = memoryview(mm).cast("q")
    import ctypes

    anchor = ctypes.c_char.from_buffer(mm)
    address = ctypes.addressof(anchor)
    start = time.monotonic()
    futex.wait(address, 5, 20.0)  # the word is 0, not 5: returns at once
    assert time.monotonic() - start < 10

    def writer():
        time.sleep(0.2)
        words[0] = 1
        shm_wait.fence()
        futex.wake(address)

    thread = threading.Thread(target=writer)
    thread.start()
    start = time.monotonic()
    while words[0] == 0 and time.monotonic() - start < 20:
        futex.wait(address, 0, 20.0)
    thread.join()
    assert words[0] == 1 and time.monotonic() - start < 10, "the wake-up was lost"
    del anchor
    words.release()
    mm.close()


def test_the_wait_policy_spins_only_with_a_cpu_per_rank():
    own = shm_wait.decide(2, 2)
    assert own.spin_s == shm_wait.SPIN_S > 0 and own.yield_s == shm_wait.YIELD_S
    for ranks, cpus in [(4, 2), (3, 2), (2, 1), (1, 1)]:
        crowded = shm_wait.decide(ranks, cpus)
        assert crowded.spin_s == 0 and crowded.yield_s == shm_wait.YIELD_CROWDED_S, (ranks, cpus)
    assert shm_wait.decide(8, 64) == own


def test_descriptors_name_the_operation_and_the_difference():
    from distlib.backends.gloo.transport import frames

    word = shm_channel.descriptor(frames.OPS["broadcast"], 11, 0, 3)
    assert shm_channel.describe(word, 10) == "broadcast of 10 x float32 from rank 3"
    mine = shm_channel.descriptor(frames.OPS["all_reduce"], 11, 1, -1)
    for other, why in [(shm_channel.descriptor(frames.OPS["reduce"], 11, 1, 0), "different collectives"),
                       (shm_channel.descriptor(frames.OPS["all_reduce"], 12, 1, -1), "different dtypes"),
                       (shm_channel.descriptor(frames.OPS["all_reduce"], 11, 3, -1), "different reduce ops"),
                       (mine, "different sizes")]:
        assert why in frames.why_mismatched(shm_channel.descriptor_fields(mine), shm_channel.descriptor_fields(other))


# -- small arrays over TCP --------------------------------------------------------------------------


@pytest.fixture(scope="module", params=[2, 3, 4], ids=lambda ws: f"ws{ws}")
def tcp_pool(request):
    pool = WorkerPool(request.param, env={"DISTLIB_SHM": "0"})
    yield pool
    pool.close()


def test_tcp_groups_have_no_channel(tcp_pool):
    assert tcp_pool.run(small_cases.channel_facts) == [None] * tcp_pool.world_size


@pytest.mark.parametrize("algorithm", ["direct", "recursive_doubling", "tree"])
@pytest.mark.parametrize("op_name", OPS)
def test_small_all_reduce_over_tcp_matches_numpy(tcp_pool, algorithm, op_name):
    per_rank = tcp_pool.run(small_cases.all_reduce_matrix_with, algorithm, op_name, cases.ALL_DTYPES, SMALL_SIZES)
    wrong = [(rank, dtype, n) for rank, rows in enumerate(per_rank) for dtype, n, ok, _ in rows if not ok]
    assert not wrong, f"{algorithm} {op_name}: results differ from numpy at (rank, dtype, size): {wrong[:10]}"
    digests = [[d for *_, d in rows] for rows in per_rank]
    assert all(d == digests[0] for d in digests), f"{algorithm} {op_name}: ranks hold different results"


@pytest.mark.parametrize("algorithm", ["direct", "recursive_doubling", "tree"])
@pytest.mark.parametrize("kind,needle", [
    ("shape", "different sizes"),
    ("dtype", "different dtypes"),
    ("collective", "different collectives"),
])
def test_mismatch_over_tcp_raises_on_every_rank_whatever_the_algorithm(tcp_pool, algorithm, kind, needle):
    """Recursive doubling and the tree send each rank frames from a few peers only, and a
    rank in a broadcast gets none from an all_reduce peer at all: the operation numbers in
    frames and heartbeats must still tell every rank."""
    for rank, (outcome, elapsed, check) in enumerate(
            tcp_pool.run(small_cases.mismatch_with_algorithm, algorithm, kind)):
        assert "mismatched collective" in outcome and needle in outcome, f"rank {rank}: {outcome!r}"
        assert elapsed < 10, f"rank {rank} took {elapsed:.1f}s to notice"
        assert check == tcp_pool.world_size


def test_the_tree_is_chosen_when_ranks_outnumber_cpus():
    from distlib.backends.gloo.sizes import choose_all_reduce

    assert choose_all_reduce(4, 4, crowded=True) == "tree"
    assert choose_all_reduce(4, 3, crowded=True) == "tree"
    assert choose_all_reduce(4, 2, crowded=True) == "direct"
    assert choose_all_reduce(4, 4, crowded=False) == "direct"
    assert choose_all_reduce(4, 16, crowded=False) == "recursive_doubling"
    assert choose_all_reduce(1 << 20, 4, crowded=True) == "ring"


# -- the mesh's own mismatch checks, on one connection ---------------------------------------------


@pytest.fixture
def mesh_with_a_peer():
    """A mesh of rank 0 of 2 whose connection to rank 1 is one end of a socket pair (the
    other end plays rank 1); no progress thread."""
    import socket

    from distlib.backends.gloo.transport.tcp import Mesh

    mine, theirs = socket.socketpair()
    mesh = Mesh(0, 2, 5.0, 1, "test")
    mesh.add_connection(1, mine, "peer:1")
    yield mesh, mesh.conns[1], theirs
    mesh.close()
    theirs.close()


def _data(op_name, dtype, seq, count, step=0, nbytes=4):
    from distlib.backends.gloo.transport import frames

    return (frames.DATA, frames.OPS[op_name], dtype, 0, seq, step, count, nbytes)


def test_a_frame_that_came_early_for_another_collective_is_caught_when_the_operation_begins(mesh_with_a_peer):
    from distlib.errors import DistBackendError
    from distlib.backends.gloo.transport import frames

    mesh, conn, _ = mesh_with_a_peer
    mesh.matching.arrive(1, _data("broadcast", 11, 7, 5, step=3), bytearray(4))  # a later step: no receive posted
    with pytest.raises(DistBackendError, match="rank 1 .* sent broadcast of 5 x float32, but this rank is in "
                                               "all_reduce of 5 x float32: the ranks called different"):
        mesh.begin(7, frames.OPS["all_reduce"], 11, 1, 5)
    assert mesh.error is not None  # and the group is aborted, so every rank hears it


def test_a_frame_of_an_operation_this_rank_finished_is_a_mismatch(mesh_with_a_peer):
    from distlib.errors import DistBackendError
    from distlib.backends.gloo.transport import frames

    mesh, conn, _ = mesh_with_a_peer
    mesh.matching.arrive(1, _data("all_reduce", 11, 6, 5), bytearray(4))
    with pytest.raises(DistBackendError, match="operation #6, which this rank finished without it"):
        mesh.begin(7, frames.OPS["all_reduce"], 11, 1, 5)


def test_frames_that_agree_or_come_later_pass(mesh_with_a_peer):
    from distlib.backends.gloo.transport import frames

    mesh, conn, _ = mesh_with_a_peer
    mesh.matching.arrive(1, (frames.DATA, frames.OPS["all_reduce"], 11, 1, 7, 1, 5, 4), bytearray(4))
    mesh.matching.arrive(1, _data("broadcast", 12, 9, 3), bytearray(4))
    mesh.begin(7, frames.OPS["all_reduce"], 11, 1, 5)
    assert mesh.error is None


def test_an_aborted_mesh_names_the_cause_not_the_frames_the_abort_left_unread(mesh_with_a_peer):
    from distlib.errors import DistBackendError
    from distlib.backends.gloo.transport import frames

    mesh, conn, _ = mesh_with_a_peer
    mesh.abort(DistBackendError("the real cause"))
    mesh.matching.arrive(1, _data("all_reduce", 2, 1, 1), bytearray(1))  # a vote the abort cut short
    with pytest.raises(DistBackendError, match="the real cause"):
        mesh.begin(2, frames.OPS["broadcast"], 0, 0, 0)


def test_a_heartbeat_from_a_peer_waiting_in_another_collective_aborts(mesh_with_a_peer):
    """Two ranks in different collectives that never send each other data: the waiting one's
    heartbeat says what it waits in."""
    from distlib.backends.gloo.transport import frames

    mesh, conn, theirs = mesh_with_a_peer
    mesh.begin(4, frames.OPS["all_reduce"], 11, 1, 10)
    text = b"waiting 2s for broadcast of 10 x float32 from rank 0"
    theirs.sendall(frames.pack(frames.HEARTBEAT, frames.OPS["broadcast"], 11, 0, 4, 0, 10, len(text)) + text)
    with conn.read_lock:
        mesh.read_frame(conn)
    assert mesh.error is not None and "rank 1 (peer:1) is waiting in broadcast of 10 x float32, but this rank " \
                                      "is in all_reduce of 10 x float32" in str(mesh.error), mesh.error


def test_a_heartbeat_about_the_same_collective_is_no_mismatch(mesh_with_a_peer):
    from distlib.backends.gloo.transport import frames

    mesh, conn, theirs = mesh_with_a_peer
    mesh.begin(4, frames.OPS["all_reduce"], 11, 1, 10)
    text = b"waiting"
    theirs.sendall(frames.pack(frames.HEARTBEAT, frames.OPS["all_reduce"], 11, 1, 4, 0, 10, len(text)) + text)
    theirs.sendall(frames.pack(frames.HEARTBEAT, frames.OPS["broadcast"], 11, 0, 3, 0, 10, len(text)) + text)
    with conn.read_lock:
        mesh.read_frame(conn)
        mesh.read_frame(conn)
    assert mesh.error is None and conn.status == "waiting"


def test_one_rule_says_whether_two_ranks_are_in_the_same_collective():
    from distlib.backends.gloo.transport import frames

    all_reduce, all_to_all = frames.OPS["all_reduce"], frames.OPS["all_to_all"]
    assert frames.agree((all_reduce, 11, 1, 5), (all_reduce, 11, 1, 5))
    assert not frames.agree((all_reduce, 11, 1, 5), (all_reduce, 11, 1, 6))
    assert frames.agree((all_to_all, 11, 0, 5), (all_to_all, 11, 0, 6))  # each rank's own share
    assert not frames.agree((all_to_all, 12, 0, 5), (all_to_all, 11, 0, 5))
    assert not frames.agree((all_reduce, 11, 1, 5, 0), (all_reduce, 11, 1, 5, 1))  # roots
    assert frames.disagreement("rank 1 (h:1)", (all_reduce, 11, 1, 5), (all_reduce, 11, 1, 6), " (20 vs 24)") == (
        "mismatched collective: rank 1 (h:1) sent all_reduce of 5 x float32, but this rank is in all_reduce of "
        "6 x float32: the arrays have different sizes on different ranks (20 vs 24)")
    assert frames.disagreement("rank 2", (frames.OPS["broadcast"], 11, 0, 5, 0), (frames.OPS["broadcast"], 11, 0, 5, 1),
                               verb="is in") == (
        "mismatched collective: rank 2 is in broadcast of 5 x float32 from rank 0, but this rank is in broadcast "
        "of 5 x float32 from rank 1: the ranks passed different roots (src/dst)")


# -- the matching of posted receives and arrived frames, without sockets -------------------------


def _matching():
    from distlib.backends.gloo.transport.matching import Matching

    return Matching(3, lambda peer: f"rank {peer} (peer:{peer})")


def _slot(nbytes=4, kind=None, op_name="all_reduce", count=1):
    from distlib.backends.gloo.transport import frames
    from distlib.backends.gloo.transport.matching import Slot

    return Slot(memoryview(bytearray(nbytes)), kind or frames.DATA, frames.OPS[op_name], 11, 1, count, "a step", 7)


def test_a_frame_fills_the_receive_posted_for_its_operation_and_step():
    from distlib.backends.gloo.transport import frames

    matching = _matching()
    slot = _slot()
    assert matching.post_data(1, 7, 2, slot) is None  # posted
    assert matching.take(2, frames.DATA, 7, 2) is None  # another peer's frame does not take it
    assert matching.take(1, frames.DATA, 7, 1) is None  # nor another step
    assert matching.take(1, frames.DATA, 7, 2) is slot
    assert matching.take(1, frames.DATA, 7, 2) is None  # taken once


def test_a_frame_that_comes_first_is_kept_until_its_receive_is_posted():
    from distlib.backends.gloo.transport import frames

    matching = _matching()
    fields = (frames.DATA, frames.OPS["all_reduce"], 11, 1, 7, 2, 1, 4)
    assert matching.arrive(1, fields, bytearray(b"abcd")) == (None, None)
    assert matching.post_data(1, 7, 2, _slot()) == (fields, bytearray(b"abcd"))
    assert matching.post_data(1, 7, 2, _slot()) is None  # used up: this one is posted


def test_point_to_point_frames_match_in_order_per_tag_and_from_any_source():
    from distlib.backends.gloo.transport import frames

    matching = _matching()
    first, second, anyone = _slot(kind=frames.P2P), _slot(kind=frames.P2P), _slot(kind=frames.P2P)
    assert matching.post_p2p(2, 5, first) is None and matching.post_p2p(2, 5, second) is None
    assert matching.post_p2p(None, 6, anyone) is None
    assert matching.take(2, frames.P2P, 5, 0) is first and matching.take(2, frames.P2P, 5, 0) is second
    assert matching.take(1, frames.P2P, 6, 0) is anyone  # tag 6 from any rank
    fields = (frames.P2P, frames.OPS["send"], 11, 0, 9, 0, 1, 4)
    assert matching.arrive(2, fields, bytearray(4)) == (None, None)
    assert matching.post_p2p(None, 9, _slot(kind=frames.P2P)) == (2, (fields, bytearray(4)))


def test_nothing_is_posted_for_a_lost_peer_but_what_it_sent_before_still_matches():
    from distlib.backends.gloo.transport import frames
    from distlib.backends.gloo.transport.matching import LOST

    matching = _matching()
    waiting = _slot()
    matching.post_data(1, 7, 0, waiting)
    fields = (frames.DATA, frames.OPS["all_reduce"], 11, 1, 7, 1, 1, 4)
    matching.arrive(1, fields, bytearray(4))
    with matching.lock:
        assert matching.drain_peer(1) == [waiting]
    assert matching.post_data(1, 7, 1, _slot()) == (fields, bytearray(4))
    assert matching.post_data(1, 7, 2, _slot()) is LOST
    assert matching.post_p2p(1, 3, _slot(kind=frames.P2P)) is LOST
    assert matching.post_data(2, 7, 2, _slot()) is None  # the other peers are not affected


def test_a_receive_whose_deadline_passed_is_withdrawn_unless_a_frame_took_it():
    from distlib.backends.gloo.transport import frames

    matching = _matching()
    slot, taken = _slot(), _slot()
    matching.post_data(1, 7, 0, slot)
    matching.post_data(1, 7, 1, taken)
    assert matching.take(1, frames.DATA, 7, 1) is taken
    assert matching.withdraw(1, slot) and not matching.withdraw(1, taken)
    assert matching.take(1, frames.DATA, 7, 0) is None


def test_a_frame_nobody_posted_for_is_checked_against_the_operation_this_rank_is_in():
    from distlib.backends.gloo.transport import frames

    matching = _matching()
    assert matching.begin(7, frames.OPS["all_reduce"], 11, 1, 5) is None
    slot, problem = matching.arrive(2, _data("broadcast", 11, 7, 5, step=4), bytearray(4))
    assert slot is None and problem == (
        "mismatched collective: rank 2 (peer:2) sent broadcast of 5 x float32, but this rank is in all_reduce of "
        "5 x float32: the ranks called different collectives (or the same ones in a different order)")
    with matching.lock:
        matching.drain_all()  # the group failed: frames are no longer checked
    assert matching.arrive(2, _data("broadcast", 11, 7, 5, step=4), bytearray(4)) == (None, None)


def test_all_receives_are_taken_out_when_the_group_fails():
    from distlib.backends.gloo.transport import frames

    matching = _matching()
    slots = [_slot(), _slot(kind=frames.P2P), _slot(kind=frames.P2P)]
    matching.post_data(1, 7, 0, slots[0])
    matching.post_p2p(2, 1, slots[1])
    matching.post_p2p(None, 1, slots[2])
    with matching.lock:
        assert sorted(map(id, matching.drain_all())) == sorted(map(id, slots))
    assert matching.take(1, frames.DATA, 7, 0) is None
