"""``distlib bench collectives --device cuda`` on a real GPU, tiny: every op validated at one and
two ranks (two share GPU 0 when there is one), nccl and gloo, with torch side by side when it is
importable and sees the GPU. Figures are printed, never asserted. Without a device: skipped."""

import json
import subprocess
import sys

import pytest

from .conftest import no_device_reason

_REASON = no_device_reason()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_REASON is not None, reason=_REASON or "")]


@pytest.mark.parametrize("backend", ["nccl", "gloo"])
@pytest.mark.parametrize("nproc", [1, 2])
def test_every_op_runs_validated(backend, nproc, tmp_path):
    out = tmp_path / "bench.json"
    done = subprocess.run(
        [sys.executable, "-m", "distlib_bench", "collectives", "--device", "cuda", "--backend", backend,
         "--nproc", str(nproc), "--ops", ",".join(("all_reduce", "all_gather", "reduce_scatter", "broadcast",
                                                   "reduce", "all_to_all")),
         "-b", "8", "-e", "1M", "-f", "64", "--iters", "5", "--warmup", "2", "--rounds", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=900)
    print(done.stdout)
    doc = json.loads(out.read_text())
    assert doc["environment"]["device"] == "cuda" and doc["environment"]["backend"] == backend
    for entry in doc["collectives"]:
        d = entry["distlib"]
        assert d["error"] is None and d["validated"] is True, entry
        if "torch" in entry and entry["torch"]["error"] is None:
            assert entry["torch"]["validated"] is True, entry
    assert sizes_of(doc, "all_reduce")[0] == 8  # the latency target's size is in every run
    assert done.returncode == 0 or [f for f in doc["failures"] if "torch" in f], done.stdout + done.stderr


def sizes_of(doc, op):
    return sorted(e["bytes"] for e in doc["collectives"] if e["op"] == op)
