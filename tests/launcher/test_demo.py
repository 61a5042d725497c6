"""`make demo` (python -m distlib_deploy.demo): a master service and 4 processes, end to end."""

from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest

from .conftest import clean_env

pytestmark = pytest.mark.timeout(120)


def test_demo_runs_and_prints_the_exchange():
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "distlib_deploy.demo"], env=clean_env(), capture_output=True, text=True,
                          timeout=90)
    elapsed = time.monotonic() - started
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert re.search(r"master service \(distlib store-server\) on 127\.0\.0\.1:\d+", out)
    assert "4 processes met through the master service" in out
    # rank 0 prints the table; distlib-run puts its rank in front of each line
    rows = re.findall(r"^\[rank0\]: (\d)\s+(\d)\s+\S+\s+(\d+)\s+0,1,2,3$", out, re.M)
    assert sorted(r[0] for r in rows) == ["0", "1", "2", "3"]
    assert len({r[2] for r in rows}) == 4  # four processes
    assert "distlib demo: ok" in out
    assert elapsed < 30  # the target is ~1-2 s; generous for a loaded machine


def test_demo_with_two_processes():
    done = subprocess.run([sys.executable, "-m", "distlib_deploy.demo", "--nproc", "2"], env=clean_env(),
                          capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stderr
    assert "2 processes met through the master service" in done.stdout


def test_demo_reports_failure_with_a_non_zero_status():
    done = subprocess.run([sys.executable, "-m", "distlib_deploy.demo", "--timeout", "0.001"], env=clean_env(),
                          capture_output=True, text=True, timeout=90)
    assert done.returncode == 1
    assert "distlib demo: FAILED" in done.stderr
