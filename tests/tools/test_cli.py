"""The `distlib` command hands `bench`, `demo` (and `cluster`) to the tools with their own
options intact; `store-server --ping` with a bad endpoint is a usage error."""

from __future__ import annotations

import subprocess
import sys


def distlib(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "distlib.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_a_tool_gets_its_own_options():
    done = distlib("--log-level", "WARNING", "demo", "--nproc", "2")
    assert done.returncode == 0, done.stderr
    assert "2 processes met through the master service" in done.stdout
    assert distlib("demo", "--help").stdout.startswith("usage: distlib demo")
    assert distlib("bench", "store", "--help").stdout.startswith("usage: distlib bench store")
    help_text = distlib("cluster", "--help").stdout
    assert help_text.startswith("usage: distlib cluster") and "JOB" in help_text and "CLUSTER_TIMEOUT" in help_text


def test_bench_needs_to_know_what_to_measure():
    done = distlib("bench")
    assert done.returncode == 2 and "choose what to measure: store, collectives" in done.stderr
    done = distlib("bench", "disks")
    assert done.returncode == 2 and "choose what to measure" in done.stderr


def test_help_lists_the_tools():
    out = distlib("--help").stdout
    for name in ("store-server", "bench", "demo", "cluster", "run"):
        assert name in out


def test_ping_with_a_bad_endpoint_is_a_usage_error():
    done = distlib("store-server", "--ping", ":29500")
    assert done.returncode == 2
    assert done.stderr.strip() == "distlib store-server: --ping: endpoint ':29500' (from the command line) has no host"
