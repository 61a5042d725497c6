"""The cluster job's model on another array module than numpy: the code path cupy takes
(products as elementwise kernels and sums, no cuBLAS; arrays moved to the host only where the
job says so) run here with numpy arrays behind a module that is not numpy, and compared with
numpy's own path. The job on a real GPU: tests/gpu/test_train_dp_gpu.py."""

from __future__ import annotations

import types

import numpy as np
import pytest

from distlib_deploy.jobs import _common as C
from distlib_deploy.jobs import train_dp

#: numpy under another name: ``xp is np`` is False, so the job takes the path it takes on cupy.
NOT_NUMPY = types.SimpleNamespace(**{k: getattr(np, k) for k in dir(np) if not k.startswith("__")})


@pytest.mark.parametrize("a_shape, b_shape", [((64, 32), (32, 64)), ((64, 64), (64,)), ((32, 64), (64, 64))])
def test_products_without_blas_equal_blas(a_shape, b_shape):
    rng = np.random.default_rng(0)
    a = rng.standard_normal(a_shape).astype(np.float32)
    b = rng.standard_normal(b_shape).astype(np.float32)
    np.testing.assert_allclose(train_dp.matmul(NOT_NUMPY, a, b), a @ b, rtol=1e-5, atol=1e-5)
    # transposed views, as the backward pass passes them
    np.testing.assert_allclose(train_dp.matmul(NOT_NUMPY, a.T, a), a.T @ a, rtol=1e-5, atol=1e-4)


def test_training_steps_agree_with_numpys_path():
    x, y = train_dp.synthetic_shard(0, 256, 32, 1234)
    models = [train_dp.MLP(32, 64, np.random.default_rng(7), xp) for xp in (np, NOT_NUMPY)]
    for step in range(10):
        batch = slice(step * 16, (step + 1) * 16)
        results = [m.loss_and_grads(x[batch], y[batch]) for m in models]
        (loss_a, acc_a, g_a), (loss_b, acc_b, g_b) = results
        assert float(loss_a) == pytest.approx(float(loss_b), rel=1e-5)
        assert float(acc_a) == float(acc_b)
        assert g_a.dtype == g_b.dtype == np.float32 and g_a.shape == g_b.shape == (models[0].numel(),)
        np.testing.assert_allclose(g_a, g_b, rtol=1e-4, atol=1e-6)
        for model, grads in zip(models, (g_a, g_b), strict=True):
            model.step(grads, 0.2, 0.9)
    np.testing.assert_allclose(models[0].flat(), models[1].flat(), rtol=1e-4, atol=1e-5)
    assert models[0].numel() == 32 * 64 + 64 + 64 + 1


def test_the_flat_buffer_round_trips_and_the_digest_is_the_host_bytes():
    model = train_dp.MLP(8, 4, np.random.default_rng(1), NOT_NUMPY)
    flat = model.flat() * 2
    model.load_flat(flat)
    np.testing.assert_array_equal(model.flat(), flat)
    other = train_dp.MLP(8, 4, np.random.default_rng(2), np)
    other.load_flat(flat)
    assert model.digest() == other.digest()


@pytest.mark.parametrize("backend, nccl", [("nccl", True), ("cpu:gloo,cuda:nccl", True), ("NCCL", True),
                                           ("gloo", False), ("cpu:gloo,cuda:gloo", False), ("mpi", False),
                                           ("cpu:gloo", False)])
def test_which_backends_put_the_job_on_cupy(backend, nccl):
    assert C.runs_nccl(backend) is nccl
