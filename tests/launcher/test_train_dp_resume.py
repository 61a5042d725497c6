"""train_dp's checkpoints (the pattern an elastic job follows): a run cut after epoch 1 and
resumed from its checkpoint ends with exactly the weights of a run that was never cut."""

from __future__ import annotations

import json

import numpy as np
import pytest

from .conftest import run_launcher

pytestmark = pytest.mark.timeout(180)

JOB = ["-m", "distlib_deploy.jobs.train_dp", "--steps", "10", "--bench-sizes", "none", "--features", "8",
       "--hidden", "8", "--timeout", "60"]


def train(tmp_path, name, epochs, *extra):
    report = tmp_path / f"{name}.json"
    done = run_launcher("--standalone", "--nproc-per-node", "2", *JOB, "--epochs", str(epochs),
                        "--report-json", str(report), *extra, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(report.read_text()), done


def test_a_resumed_run_ends_with_the_weights_of_an_uncut_run(tmp_path):
    whole, _ = train(tmp_path, "whole", 2)
    ckpt = tmp_path / "ckpt" / "train_dp.npz"
    first, _ = train(tmp_path, "first", 1, "--checkpoint", str(ckpt), "--checkpoint-every", "5")
    with np.load(ckpt) as data:
        assert int(data["next_step"]) == 10
    second, done = train(tmp_path, "second", 2, "--checkpoint", str(ckpt), "--checkpoint-every", "5")
    assert f"resumed from the checkpoint {ckpt} at step 10" in done.stdout
    assert second["elastic"]["resumed_from_step"] == 10
    assert [e["epoch"] for e in second["epochs"]] == [2]  # epoch 1 was in the checkpoint
    assert second["weights"]["sha256"][0] == whole["weights"]["sha256"][0]
    assert first["weights"]["sha256"][0] != whole["weights"]["sha256"][0]


def test_a_checkpoint_of_another_model_is_refused_saying_so(tmp_path):
    ckpt = tmp_path / "train_dp.npz"
    train(tmp_path, "small", 1, "--checkpoint", str(ckpt))
    done = run_launcher("--standalone", "--nproc-per-node", "1", *JOB, "--hidden", "16", "--epochs", "1",
                        "--checkpoint", str(ckpt), timeout=120)
    assert done.returncode != 0
    assert "holds 81 parameters, this model has 161: a checkpoint of another --features/--hidden" in done.stderr
