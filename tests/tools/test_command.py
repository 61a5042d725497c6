"""distlib/command.py: the scaffold every tool's command line is built on."""

from __future__ import annotations

import argparse
import json
import logging
import sys

import pytest

from distlib import command
from distlib.command import ToolError


@pytest.mark.parametrize("text, expected", [
    ("master:29501", ("master", 29501)),
    ("master", ("master", 29500)),
    ("[::1]:7", ("::1", 7)),
    ("[fe80::1]", ("fe80::1", 29500)),
    ("10.0.0.5:0", ("10.0.0.5", 0)),
])
def test_endpoints(text, expected):
    assert command.parse_endpoint(text) == expected


@pytest.mark.parametrize("text, words", [
    (":29500", "has no host"),
    ("master:http", "port"),
    ("master:70000", "port"),
    ("[::1", "IPv6"),
])
def test_a_bad_endpoint_says_what_is_wrong(text, words):
    with pytest.raises(ValueError, match=words):
        command.parse_endpoint(text)
    with pytest.raises(argparse.ArgumentTypeError, match=words):
        command.endpoint_arg(text)


def test_a_tool_error_is_one_line_and_its_status(capsys):
    def body():
        raise ToolError("the master at m:1 did not answer within 5 s", 3)

    assert command.run("distlib thing", body) == 3
    err = capsys.readouterr().err
    assert err == "distlib thing: the master at m:1 did not answer within 5 s\n"


def test_an_interrupt_is_130_and_a_bug_keeps_its_traceback(capsys):
    def interrupted():
        raise KeyboardInterrupt

    assert command.run("distlib thing", interrupted) == 130
    assert "distlib thing: interrupted" in capsys.readouterr().err
    with pytest.raises(ZeroDivisionError):
        command.run("distlib thing", lambda: 1 // 0)
    assert command.run("distlib thing", lambda: 0) == 0


def test_json_to_a_file_and_to_stdout(tmp_path, capsys):
    path = tmp_path / "out.json"
    command.write_json(str(path), {"x": [1, 2]})
    assert json.loads(path.read_text()) == {"x": [1, 2]}
    command.write_json("-", {"y": 1})
    assert json.loads(capsys.readouterr().out) == {"y": 1}
    assert command.text_stream("-") is sys.stderr and command.text_stream("f.json") is sys.stdout


def test_common_flags_and_the_later_log_level_wins():
    parser = argparse.ArgumentParser()
    command.add_log_level(parser)
    command.add_json(parser)
    command.add_quiet(parser)
    args = parser.parse_args(["--json", "-", "--quiet"])
    assert args.json == "-" and args.quiet and "log_level" not in args  # the outer command's level stays
    assert parser.parse_args(["--log-level", "DEBUG"]).log_level == "DEBUG"
    root = logging.getLogger()
    saved = root.level, list(root.handlers)
    try:
        command.setup_logging("ERROR")
        command.setup_logging("DEBUG")
        assert root.level == logging.DEBUG and len(root.handlers) == 1
    finally:
        root.handlers[:] = saved[1]
        root.setLevel(saved[0])
