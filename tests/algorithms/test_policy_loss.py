"""PPO policy loss (clip, clip-higher, dual clip, TIS) and value loss against hand-computed numbers."""

from __future__ import annotations

import math

import pytest
import torch

from rlhfkit.algorithms.policy_loss import policy_loss, tis_weights, value_loss
from rlhfkit.errors import UserError

F64 = torch.float64
NAN = float("nan")


def close(actual: torch.Tensor, expected, tol: float = 1e-9) -> None:
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=tol, rtol=0)


def tokens():
    """Five action tokens over two rows (NaN log-probs at padding), ratios and advantages:

    t0: ratio 1.5, A = +1 -> min(1.5, 1.2) = 1.2       loss -1.2  (clipped)
    t1: ratio 0.5, A = +2 -> min(1.0, 0.8*2 = 1.6)     loss -1.0
    t2: ratio 0.5, A = -1 -> min(-0.5, -0.8) = -0.8    loss  0.8  (clipped)
    t3: ratio 1.0, A = +3 ->                           loss -3.0
    t4: ratio 4.0, A = -1 -> min(-4, -1.2) = -4        loss  4.0  (dual clip 3 -> 3.0)
    """
    old = torch.tensor([[-1.0, -1.0, -1.0, NAN], [-2.0, -2.0, NAN, NAN]], dtype=F64)
    ratios = torch.tensor([[1.5, 0.5, 0.5, 1.0], [1.0, 4.0, 1.0, 1.0]], dtype=F64)
    logp = (old + ratios.log()).clone().requires_grad_(True)
    adv = torch.tensor([[1.0, 2.0, -1.0, NAN], [3.0, -1.0, NAN, NAN]], dtype=F64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    return logp, old, adv, mask


def test_symmetric_clip_values_gradient_and_info():
    logp, old, adv, mask = tokens()
    loss, info = policy_loss(logp, old, adv, mask, clip_eps_low=0.2)
    close(loss, -0.08)  # (-1.2 - 1.0 + 0.8 - 3.0 + 4.0) / 5
    close(info["clip_fraction"], 0.4)  # t0, t2
    # approx KL = mean((ratio - 1) - log ratio) = (0.5 - ln 1.5 + 2 * (ln 2 - 0.5) + 0 + 3 - ln 4) / 5
    close(info["approx_kl"], 0.4189069783783671)
    close(info["ratio_mean"], 1.5)  # (1.5 + 0.5 + 0.5 + 1 + 4) / 5
    loss.backward()
    # d/dlogp of -ratio*A/5 where unclipped: t1 -2*0.5/5 = -0.2; t3 -3/5 = -0.6; t4 +4/5 = 0.8; clipped and padding 0
    close(logp.grad, [[0.0, -0.2, 0.0, 0.0], [-0.6, 0.8, 0.0, 0.0]])
    assert all(not v.requires_grad for v in info.values())


def test_clip_higher():
    logp, old, adv, mask = tokens()
    loss, info = policy_loss(logp, old, adv, mask, clip_eps_low=0.2, clip_eps_high=0.28)
    close(loss, -0.096)  # t0 becomes -1.28: (-1.28 - 1.0 + 0.8 - 3.0 + 4.0) / 5
    close(info["clip_fraction"], 0.4)


def test_dual_clip_bounds_negative_advantages():
    logp, old, adv, mask = tokens()
    loss, info = policy_loss(logp, old, adv, mask, dual_clip=3.0)
    close(loss, -0.28)  # t4: min(4, 3 * |-1|) = 3 -> (-1.2 - 1.0 + 0.8 - 3.0 + 3.0) / 5
    close(info["dual_clip_fraction"], 0.2)
    loss.backward()
    close(logp.grad, [[0.0, -0.2, 0.0, 0.0], [-0.6, 0.0, 0.0, 0.0]])  # the dual-clipped token has no gradient
    with pytest.raises(UserError, match="dual_clip must be > 1"):
        policy_loss(logp, old, adv, mask, dual_clip=1.0)


def test_aggregation_modes():
    logp, old, adv, mask = tokens()
    loss, _ = policy_loss(logp, old, adv, mask, agg="seq_mean_token_mean")
    close(loss, ((-1.2 - 1.0 + 0.8) / 3 + (-3.0 + 4.0) / 2) / 2)  # (-0.4666667 + 0.5) / 2 = 0.0166667
    loss, _ = policy_loss(logp, old, adv, mask, agg="seq_mean_token_sum_norm", norm_len=10)
    close(loss, ((-1.2 - 1.0 + 0.8) / 10 + (-3.0 + 4.0) / 10) / 2)  # -0.02
    loss, _ = policy_loss(logp, old, adv, mask, num_tokens=20)
    close(loss, -0.02)  # -0.4 / 20


def test_truncated_importance_sampling():
    logp, old, adv, mask = tokens()
    weights = torch.tensor([[0.5, 3.0, 1.0, 1.0], [1.5, 1.0, 1.0, 1.0]], dtype=F64)
    rollout = old - weights.log()  # exp(old - rollout) = weights; capped at 2 -> [0.5, 2, 1 | 1.5, 1]
    loss, info = policy_loss(logp, old, adv, mask, rollout_logp=rollout, tis_cap=2.0)
    close(loss, -0.46)  # (-1.2*0.5 - 1.0*2 + 0.8*1 - 3.0*1.5 + 4.0*1) / 5 = -2.3 / 5
    close(info["tis_weight_mean"], 1.2)  # (0.5 + 2 + 1 + 1.5 + 1) / 5
    with pytest.raises(UserError, match="both"):
        policy_loss(logp, old, adv, mask, rollout_logp=rollout)


def test_tis_weights():
    old = torch.tensor([math.log(0.5), math.log(3.0), 100.0])
    out = tis_weights(old, torch.zeros(3), cap=2.0)
    close(out, [0.5, 2.0, 2.0], tol=1e-6)  # min(exp(old - rollout), 2); exp(100) overflows to inf -> 2


def test_value_loss_clipped_and_unclipped():
    values = torch.tensor([[1.5, 2.0, 0.0, NAN]], dtype=F64, requires_grad=True)
    old = torch.tensor([[1.0, 1.0, 0.5, NAN]], dtype=F64)
    returns = torch.tensor([[1.6, 1.0, 1.0, NAN]], dtype=F64)
    mask = torch.tensor([[1, 1, 1, 0]])
    # unclipped errors: 0.01, 1, 1 -> 0.5 * 2.01 / 3
    loss, _ = value_loss(values, old, returns, mask)
    close(loss, 0.335)
    # clip 0.2: V_clip = 1.2, 1.2, 0.3 -> errors 0.16, 0.04, 0.49; max with unclipped: 0.16, 1, 1 -> 0.5 * 2.16 / 3
    loss, info = value_loss(values, old, returns, mask, value_clip=0.2)
    close(loss, 0.36)
    close(info["value_clip_fraction"], 1 / 3)
    loss.backward()
    # t0 takes the clipped branch (no gradient); t1: (2 - 1)/3; t2: (0 - 1)/3
    close(values.grad, [[0.0, 1 / 3, -1 / 3, 0.0]])
