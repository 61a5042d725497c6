"""distlib/refusals.py: a listener's refusals, once per address per interval with a count
(the store server's and, through it, what an operator reads during a flood)."""

from __future__ import annotations

import logging

from distlib.refusals import OTHER, RefusalLog


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def make(caplog, **kwargs):
    caplog.set_level(logging.DEBUG, "test.refusals")
    clock = Clock()
    return RefusalLog(logging.getLogger("test.refusals"), interval_s=10.0, clock=clock, **kwargs), clock


def test_the_first_refusal_is_logged_in_full_the_rest_counted_in_one_line(caplog):
    refusals, clock = make(caplog)
    assert refusals.refused("10.0.0.9", "closed connection of client 10.0.0.9:1: wrong token", "wrong token")
    for port in range(2, 6):
        assert not refusals.refused("10.0.0.9", f"closed connection of client 10.0.0.9:{port}: wrong token",
                                    "wrong token")
    assert not refusals.refused("10.0.0.9", "...", "silent")
    assert [r.getMessage() for r in caplog.records] == [
        "closed connection of client 10.0.0.9:1: wrong token (further refusals of 10.0.0.9 in the next 10.0s are "
        "counted in one line)"]
    assert refusals.due == 110.0
    clock.now = 109.9
    refusals.flush()
    assert len(caplog.records) == 1
    clock.now = 110.0
    refusals.flush()
    assert caplog.records[-1].getMessage() == "5 more refusals of 10.0.0.9 in 10.0s: 4 x wrong token; 1 x silent"
    assert caplog.records[-1].levelno == logging.WARNING
    assert refusals.due is None
    assert refusals.totals == {"10.0.0.9": [6, "silent"]}
    assert refusals.summary() == "6 from 10.0.0.9 (last: silent)"


def test_addresses_are_counted_apart_and_a_new_interval_logs_in_full_again(caplog):
    refusals, clock = make(caplog)
    refusals.refused("a", "A1")
    refusals.refused("b", "B1")
    refusals.refused("a", "A2")
    clock.now += 11
    refusals.refused("a", "A3")  # the old interval's count first, then a full line
    messages = [r.getMessage() for r in caplog.records]
    assert messages[0].startswith("A1 (") and messages[1].startswith("B1 (")
    assert messages[2] == "1 more refusals of a in 10.0s: 1 x A2"
    assert messages[3].startswith("A3 (")


def test_the_count_line_has_the_highest_level_and_at_most_four_reasons(caplog):
    refusals, clock = make(caplog)
    refusals.refused("a", "first", level=logging.INFO)
    for i in range(6):
        refusals.refused("a", f"r{i}", level=logging.WARNING if i == 3 else logging.INFO)
    refusals.flush(final=True)
    last = caplog.records[-1]
    assert last.levelno == logging.WARNING
    assert last.getMessage() == "6 more refusals of a in 10.0s: 1 x r0; 1 x r1; 1 x r2; 1 x r3; 2 x other reasons"


def test_addresses_past_the_bound_share_one_entry(caplog):
    refusals, clock = make(caplog, max_addresses=2)
    for address in ("a", "b", "c", "d"):
        refusals.refused(address, address)
    assert sorted(refusals.totals) == sorted(["a", "b", OTHER])
    assert refusals.totals[OTHER][0] == 2
    assert len(caplog.records) == 3  # c in full (as "other addresses"); d counted
