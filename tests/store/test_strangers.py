"""The budget of strangers (distlib/store/tcp/strangers.py), with no sockets: who makes room for
whom, and who is overdue."""

from __future__ import annotations

import pytest

from distlib.store.tcp.strangers import Strangers


class Gate:
    def __init__(self, answer_by: float):
        self.answer_by = answer_by


class Conn:
    def __init__(self, name: str, host: str, answer_by: float = 0.0):
        self.name, self.host, self.gate = name, host, Gate(answer_by)

    def __repr__(self) -> str:
        return self.name


def test_at_the_cap_of_an_address_its_oldest_stranger_makes_room():
    table = Strangers(per_host=3, total=100)
    a = [Conn(f"a{i}", "10.0.0.1") for i in range(3)]
    b = Conn("b0", "10.0.0.2")
    for conn in a[:2] + [b] + a[2:]:
        assert table.make_room(conn.host) == []
        table.add(conn)
    assert table.make_room("10.0.0.1") == [a[0]]  # the oldest of that address, not b0
    assert table.make_room("10.0.0.2") == []
    assert (table.of("10.0.0.1"), table.of("10.0.0.2"), len(table)) == (2, 1, 3)


def test_at_the_total_cap_the_oldest_of_all_makes_room():
    table = Strangers(per_host=10, total=3)
    conns = [Conn("a0", "h1"), Conn("b0", "h2"), Conn("a1", "h1")]
    for conn in conns:
        table.add(conn)
    assert table.make_room("h3") == [conns[0]]
    assert conns[0] not in table and len(table) == 2


def test_a_stranger_that_proved_itself_or_closed_is_no_longer_counted():
    table = Strangers(per_host=2, total=10)
    first, second = Conn("a0", "h"), Conn("a1", "h")
    table.add(first)
    table.add(second)
    assert table.remove(first) is True
    assert table.remove(first) is False  # (twice: nothing)
    assert table.make_room("h") == []  # one left, room for one more
    assert table.oldest() is second


def test_overdue_strangers_are_the_oldest_whose_time_ran_out():
    table = Strangers()
    conns = [Conn(f"c{i}", "h", answer_by=float(i)) for i in range(5)]
    for conn in conns:
        table.add(conn)
    assert table.overdue(2.0) == conns[:3]
    assert table.next_due() == 3.0
    assert table.overdue(2.5) == []
    assert table.overdue(10.0) == conns[3:] and table.next_due() is None and len(table) == 0


def test_budgets_below_one_are_refused():
    with pytest.raises(ValueError, match="at least 1"):
        Strangers(per_host=0)
