"""The elastic flags: when a launch is elastic, --rdzv-conf's keys, and what cannot be elastic."""

from __future__ import annotations

import pytest

from distlib.launcher.elastic_config import RdzvConf, elastic_plan, is_elastic, parse_rdzv_conf
from distlib.launcher.resolve import Flags, ResolveError, resolve


def res(env=None, **flags):
    return resolve(Flags(**flags), env or {})


def test_torchs_defaults_and_a_10_s_heartbeat_bound():
    conf, notes = parse_rdzv_conf(None)
    assert conf == RdzvConf() and notes == []
    assert (conf.join_timeout, conf.last_call_timeout, conf.close_timeout) == (600, 30, 30)
    assert conf.heartbeat_bound == 10.0


def test_keys_set_values_and_torch_only_keys_are_noted():
    conf, notes = parse_rdzv_conf("join_timeout=90, keep_alive_interval=0.5,keep_alive_max_attempt=3,is_host=1")
    assert (conf.join_timeout, conf.heartbeat_bound) == (90, 1.5)
    assert notes == ["--rdzv-conf is_host=1: torch's key, not used by distlib-run (ignored)"]


@pytest.mark.parametrize("text, words", [
    ("join_timeout", "'join_timeout' is not key=value"),
    ("join_timeout=soon", "join_timeout='soon' (from flag --rdzv-conf): not a number of seconds"),
    ("last_call_timeout=0", "must be a positive number of seconds"),
    ("keep_alive_max_attempt=0", "must be at least 1"),
    ("heartbeat=3", "unknown key 'heartbeat'"),
])
def test_bad_values_name_the_key(text, words):
    with pytest.raises(ResolveError, match=words.replace("(", r"\(").replace(")", r"\)")):
        parse_rdzv_conf(text)


@pytest.mark.parametrize("flags, restarts, elastic", [
    ({"nnodes": "2"}, 0, False),
    ({"nnodes": "2:2"}, 0, False),
    ({"nnodes": "2"}, 1, True),
    ({"nnodes": "1:3", "rdzv_backend": "c10d", "rdzv_endpoint": "m:1"}, 0, True),
    ({"rdzv_backend": "c10d", "rdzv_endpoint": "file:///s/r"}, 0, True),
])
def test_when_a_launch_is_elastic(flags, restarts, elastic):
    assert is_elastic(res(**flags), restarts) is elastic


@pytest.mark.parametrize("flags, env, words", [
    ({"nnodes": "1:3"}, {}, "with --rdzv-backend static: static means a fixed set of nodes"),
    ({"nnodes": "1:3", "rdzv_backend": "c10d", "rdzv_endpoint": "m:1"}, {"DISTLIB_INIT_METHOD": "file:///s/x"},
     "restarts and membership changes need a store for every round"),
    ({"standalone": True}, {}, None),
])
def test_what_cannot_be_elastic_says_why(flags, env, words):
    resolved = res(env, **flags)
    if words is None:  # a single node on a private store may restart
        assert elastic_plan(resolved, 2, 0.1, None).max_restarts == 2
        return
    with pytest.raises(ResolveError, match=words):
        elastic_plan(resolved, 1, 0.1, None)


def test_a_file_endpoint_that_cannot_be_opened_fails_at_once_naming_it(tmp_path):
    import subprocess

    from .conftest import clean_env, launcher_cmd

    blocked = tmp_path / "not-a-dir"
    blocked.write_text("")
    done = subprocess.run(launcher_cmd("--nnodes", "2:3", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                                       f"file://{blocked}/rdzv", "--rdzv-id", "x", "x.py"),
                          env=clean_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert f"the rendezvous store at {blocked}/rdzv cannot be opened:" in done.stderr, done.stderr


def test_an_elastic_launch_without_a_token_warns_what_it_exposes(tmp_path, store_server):
    """An elastic launch whose store other hosts reach (here: up to 2 nodes) and no token: the
    warning every distlib-run launch gives, and what it costs an elastic job. (Before: an elastic
    launch handed over to its agent before the warning.)"""
    import subprocess

    from .conftest import clean_env, launcher_cmd

    script = tmp_path / "ok.py"
    script.write_text("pass\n")
    done = subprocess.run(launcher_cmd("--nnodes", "1:2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                                       f"127.0.0.1:{store_server}", "--rdzv-id", "open", "--rdzv-conf",
                                       "last_call_timeout=0.1", str(script)),
                          env=clean_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert (f"this job's store (127.0.0.1:{store_server}) and its ranks' listeners run without a token: anyone who "
            "reaches them can join and send objects that are unpickled; the store also holds this elastic job's "
            "rounds: anyone who reaches it can end the job or use up its restarts: set DISTLIB_AUTH_TOKEN_FILE") \
        in done.stderr, done.stderr


def test_the_store_outage_bound_is_60_s_unless_the_flag_or_its_variable_says_otherwise():
    """--store-outage-timeout, its variable DISTLIB_STORE_OUTAGE_TIMEOUT, and --dry-run's line."""
    from tests.launcher.conftest import clean_env, run_launcher

    base = ("--dry-run", "--nnodes", "2:3", "--rdzv-backend", "c10d", "--rdzv-endpoint", "master:29500", "train.py")
    rows = {}
    for name, args, env in (("default", (), {}), ("flag", ("--store-outage-timeout", "90"), {}),
                            ("variable", (), {"DISTLIB_STORE_OUTAGE_TIMEOUT": "45"})):
        done = run_launcher(*args, *base, env=clean_env(**env))
        assert done.returncode == 0, done.stderr
        rows[name] = next(line.strip() for line in done.stdout.splitlines() if line.strip().startswith("store outage"))
    assert rows["default"].split()[3:5] == ["60", "s"], rows
    assert rows["flag"].split()[3:5] == ["90", "s"] and rows["variable"].split()[3:5] == ["45", "s"], rows
    assert "--store-outage-timeout" in rows["default"]
    bad = run_launcher(*base, env=clean_env(DISTLIB_STORE_OUTAGE_TIMEOUT="soon"))
    assert bad.returncode == 2 and "--store-outage-timeout: not a number of seconds: 'soon'" in bad.stderr, bad.stderr
    with pytest.raises(ResolveError, match="--store-outage-timeout must be 0 or more seconds"):
        elastic_plan(res(nnodes="2:3", rdzv_backend="c10d", rdzv_endpoint="m:1"), 0, 0.1, None, float("nan"))
