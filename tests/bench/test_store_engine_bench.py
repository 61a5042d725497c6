"""``python -m distlib_bench.store_engine``: both runs count every ADD, and the report gives
the two medians and what numbering costs."""

from __future__ import annotations

import re

import pytest

from distlib_bench import store_engine


def test_the_engine_bench_reports_both_costs(capsys):
    assert store_engine.main(["--requests", "2000", "--rounds", "2"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^  plain\s+\d+\.\d\d us", out, re.M), out
    assert re.search(r"^  numbered\s+\d+\.\d\d us", out, re.M), out
    assert re.search(r"numbering costs -?\d+\.\d\d us per write \(\d+\.\d\dx\)", out), out


def test_bad_counts_are_refused():
    with pytest.raises(SystemExit) as info:
        store_engine.main(["--requests", "0"])
    assert info.value.code == 2
