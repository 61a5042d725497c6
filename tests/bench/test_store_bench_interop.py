"""``distlib bench store`` with torch importable: both implementations measured, interleaved,
with speed-ups and target verdicts. Needs torch (``make test-interop``)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("torch", reason="torch not importable: run `make test-interop`")

pytestmark = pytest.mark.interop


def test_quick_run_against_torch(tmp_path):
    out = tmp_path / "store.json"
    result = subprocess.run(
        [sys.executable, "-m", "distlib_bench", "store", "--quick", "--sections", "single,barrier,filestore",
         "--json", str(out), "--quiet"],
        capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    doc = json.loads(out.read_text())
    assert doc["implementations"] == ["distlib", "torch"]
    assert doc["environment"]["torch"].startswith("2.")
    for row in doc["rows"]:
        assert row["distlib"]["median"] > 0 and row["torch"]["median"] > 0, row
        assert row["speedup"] > 0
        if row["target"]:
            assert row["result"] in ("PASS", "MISS")
    assert "speed-up" in result.stdout and "torch" in result.stdout.splitlines()[0]
