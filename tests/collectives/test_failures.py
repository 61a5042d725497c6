"""A rank dies mid-collective: the others raise DistBackendError naming it, well within the
group timeout, and their processes exit (no hang, no thread keeping them alive)."""


import pytest

from . import group_cases
from .harness import spawn
from tests.fixtures.ports import free_port


@pytest.mark.parametrize("victim", [0, 1, 2])
def test_killed_rank_is_named_by_the_others(victim):
    ws = 3
    results = spawn(group_cases.killed_during_all_reduce, ws, free_port(), victim, timeout=120)
    for rank, (code, outcome) in enumerate(results):
        if rank == victim:
            assert code == -9, f"the victim should have died by SIGKILL, exit {code}"
            continue
        assert code == 0, f"rank {rank} did not exit cleanly: {code} {outcome}"
        status, (text, elapsed) = outcome
        assert status == "ok"
        assert f"rank {victim} (" in text and "closed the connection" in text, f"rank {rank}: {text}"
        assert elapsed < 30, f"rank {rank} needed {elapsed:.1f}s (group timeout 60s)"


def test_timeout_blames_the_silent_rank_not_the_waiting_neighbour(tmp_path):
    """In a ring every rank waits on its left neighbour; the heartbeats of the waiting ranks
    let each timeout error say which rank actually went silent."""
    ws, silent = 4, 2
    results = spawn(group_cases.silent_rank_during_ring, ws, str(tmp_path / "s"), silent, timeout=120)
    for rank, (code, (status, (text, elapsed))) in enumerate(results):
        assert status == "ok" and code == 0, (rank, code, text)
        if rank == silent:
            continue
        assert f"Silent: rank {silent} (" in text, f"rank {rank}: {text}"
        # only the silent rank: a live rank blocked sending to it heartbeats too
        silent_list = text.split("Silent: ", 1)[1].split(" — ", 1)[0]
        assert silent_list.count("rank ") == 1, f"rank {rank} names live ranks as silent: {text}"
        assert elapsed < 9 + 10, f"rank {rank}: {elapsed:.1f}s"
    # whichever rank's timer fires first reports for everyone; if it waited on a live
    # neighbour, it says that neighbour is alive (and never that the silent rank is)
    for _, (_, (text, _)) in results:
        if "is alive" in text:
            assert f"rank {silent} (" not in text.split("is alive")[0].split("from ")[-1], text


def test_a_rank_blocked_sending_to_a_stopped_rank_is_reported_alive(tmp_path):
    """A send blocks when its receiver stops reading (cut off, SIGSTOPped). The blocked
    sender's heartbeats must say so, or the ranks waiting on it would call it silent and
    send the user to the wrong host."""
    results = spawn(group_cases.sender_blocked_on_a_stopped_rank, 3, str(tmp_path / "s"), timeout=120)
    code, (status, (text, elapsed)) = results[0]
    assert code == 0 and status == "ok", (code, text)
    assert "rank 0 timed out after 7.0s waiting for" in text and "from rank 1 (" in text, text
    assert "rank 1 (" in text and "is alive: it is waiting" in text, text
    assert "to send" in text and "to rank 2 (" in text, text
    assert "Silent: rank 2 (" in text, text
    silent_list = text.split("Silent: ", 1)[1].split(" — ", 1)[0]
    assert silent_list.count("rank ") == 1, text
    assert results[2][0] == -9  # the stopped rank, killed by rank 0


def test_a_rank_whose_progress_thread_is_stuck_mid_frame_is_reported_alive(tmp_path):
    """A peer cut off in the middle of a frame leaves the progress thread reading the rest;
    the rank's waiting threads must keep its heartbeats going, or the ranks waiting on it
    would call it silent (seen with `docker network disconnect`)."""
    results = spawn(group_cases.progress_thread_stuck_mid_frame, 3, str(tmp_path / "s"), timeout=120)
    code, (status, (text, elapsed)) = results[0]
    assert code == 0 and status == "ok", (code, text)
    assert "rank 0 timed out after 7.0s waiting for" in text and "from rank 1 (" in text, text
    assert "rank 1 (" in text and "is alive: it is waiting" in text, text
    silent_list = text.split("Silent: ", 1)[1].split(" — ", 1)[0]
    assert silent_list.startswith("rank 2 (") and silent_list.count("rank ") == 1, text
    assert results[2][0] == -9
