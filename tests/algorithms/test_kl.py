"""KL estimators and KL controllers against hand-computed numbers."""

from __future__ import annotations

import pytest
import torch

from rlhfkit.algorithms.kl import (
    AdaptiveKLController,
    FixedKLController,
    compute_approx_kl,
    kl_k1,
    kl_k2,
    kl_k3,
    make_kl_controller,
)

NAN = float("nan")


def close(actual: torch.Tensor, expected, tol: float = 1e-9) -> None:
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=tol, rtol=0)


def inputs():
    # log_ratio = logp - ref_logp = [0.5, -1.0, 0.0, <padding>]
    logp = torch.tensor([[-1.0, -2.0, -0.5, NAN]], dtype=torch.float64)
    ref = torch.tensor([[-1.5, -1.0, -0.5, -3.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0]])
    return logp, ref, mask


def test_k1_k2_k3_values():
    logp, ref, mask = inputs()
    close(kl_k1(logp, ref, mask), [[0.5, -1.0, 0.0, 0.0]])
    close(kl_k2(logp, ref, mask), [[0.125, 0.5, 0.0, 0.0]])  # 0.5 * 0.25, 0.5 * 1
    # k3 = exp(-r) - 1 + r: exp(-0.5) - 0.5 = 0.6065306597 - 0.5; exp(1) - 2 = 0.7182818285
    close(kl_k3(logp, ref, mask), [[0.10653065971263342, 0.7182818284590451, 0.0, 0.0]])
    for name, fn in (("k1", kl_k1), ("k2", kl_k2), ("k3", kl_k3)):
        assert torch.equal(compute_approx_kl(logp, ref, name, mask), fn(logp, ref, mask))


def test_k3_gradient_and_no_nan_from_padding():
    logp, ref, mask = inputs()
    logp = logp.clone().requires_grad_(True)
    kl_k3(logp, ref, mask).sum().backward()
    # d k3 / d logp = 1 - exp(-r): 1 - exp(-0.5) = 0.3934693403; 1 - e = -1.7182818285; 0; padding 0
    close(logp.grad, [[0.3934693402873666, 1 - 2.718281828459045, 0.0, 0.0]])


def test_clamp_bounds_the_log_ratio():
    logp = torch.tensor([15.0, -15.0, 3.0], dtype=torch.float64)
    ref = torch.zeros(3, dtype=torch.float64)
    close(compute_approx_kl(logp, ref, "k1", clamp=10.0), [10.0, -10.0, 3.0])
    close(compute_approx_kl(logp, ref, "k2", clamp=10.0), [50.0, 50.0, 4.5])


def test_low_precision_inputs_give_float32():
    logp = torch.tensor([-1.0, -2.0], dtype=torch.bfloat16)
    ref = torch.tensor([-1.5, -1.0], dtype=torch.bfloat16)
    out = compute_approx_kl(logp, ref, "k3")
    assert out.dtype == torch.float32
    close(out, [0.10653065971263342, 0.7182818284590451], tol=1e-6)


def test_unknown_estimator():
    with pytest.raises(ValueError, match="unknown KL estimator"):
        compute_approx_kl(torch.zeros(2), torch.zeros(2), "k4")


def test_adaptive_controller_follows_ziegler():
    ctl = AdaptiveKLController(init_kl_coef=0.1, target=6.0, horizon=10000)
    # error = clip(9/6 - 1, -0.2, 0.2) = 0.2; value = 0.1 * (1 + 0.2 * 256/10000) = 0.1 * 1.00512
    assert ctl.update(9.0, 256) == pytest.approx(0.100512, abs=1e-12)
    # error = 5.4/6 - 1 = -0.1; value = 0.100512 * (1 - 0.1 * 1000/10000) = 0.100512 * 0.99
    assert ctl.update(5.4, 1000) == pytest.approx(0.09950688, abs=1e-12)
    assert ctl.value == pytest.approx(0.09950688, abs=1e-12)


def test_fixed_controller_and_factory():
    ctl = FixedKLController(0.05)
    assert ctl.update(100.0, 10**6) == 0.05 and ctl.value == 0.05
    assert isinstance(make_kl_controller(0.05), FixedKLController)
    assert isinstance(make_kl_controller(0.05, target=6.0, horizon=100), AdaptiveKLController)
    with pytest.raises(ValueError, match="target > 0"):
        AdaptiveKLController(0.1, target=0.0, horizon=10)
