"""DISTLIB_DEBUG (and torch's TORCH_DISTRIBUTED_DEBUG) set the distlib log level."""

import logging

import pytest

from distlib import debug


@pytest.mark.parametrize("value,level", [("off", logging.WARNING), ("INFO", logging.INFO), ("Detail", logging.DEBUG)])
def test_levels(monkeypatch, value, level):
    monkeypatch.setenv("DISTLIB_DEBUG", value)
    debug.configure(0)
    assert logging.getLogger("distlib").level == level


def test_torch_variable_is_read_when_ours_is_unset(monkeypatch):
    monkeypatch.delenv("DISTLIB_DEBUG", raising=False)
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "info")
    assert debug.debug_level() == "INFO"


def test_bad_value(monkeypatch):
    monkeypatch.setenv("DISTLIB_DEBUG", "LOUD")
    with pytest.raises(RuntimeError, match="The value of DISTLIB_DEBUG must"):
        debug.debug_level()
