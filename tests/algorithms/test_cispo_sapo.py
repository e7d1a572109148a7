"""CISPO and SAPO policy losses: loss and gradient against float64 hand computations written here with `math`."""

from __future__ import annotations

import math

import pytest
import torch

from rlhfkit.algorithms.policy_loss import policy_loss

F64 = torch.float64
NAN = float("nan")


def close(actual: torch.Tensor, expected, tol: float = 1e-12) -> None:
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=tol, rtol=0)


# Five action tokens over two rows (padding: NaN), as (old log-prob, ratio, advantage).
TOKENS = [[(-1.0, 1.5, 1.0), (-1.0, 0.5, 2.0), (-1.0, 0.5, -1.0)], [(-2.0, 1.0, 3.0), (-2.0, 4.0, -1.0)]]


def batch():
    old = torch.full((2, 4), NAN, dtype=F64)
    logp = torch.full((2, 4), NAN, dtype=F64)
    adv = torch.full((2, 4), NAN, dtype=F64)
    mask = torch.zeros(2, 4, dtype=torch.long)
    for b, row in enumerate(TOKENS):
        for t, (o, r, a) in enumerate(row):
            old[b, t], logp[b, t], adv[b, t], mask[b, t] = o, o + math.log(r), a, 1
    return logp.requires_grad_(True), old, adv, mask


def per_token(fn) -> list[list[tuple[float, float]]]:
    """(loss, d loss / d logp) of every token by `fn(old, ratio, advantage)`."""
    return [[fn(o, r, a) for o, r, a in row] for row in TOKENS]


def token_mean(values, index: int) -> float:
    flat = [v[index] for row in values for v in row]
    return sum(flat) / len(flat)


def grads(values, n: int) -> list[list[float]]:
    """The gradient of the token mean: each token's own derivative / n, 0 at padding."""
    return [[v[1] / n for v in row] + [0.0] * (4 - len(row)) for row in values]


def cispo_hand(low: float, high: float):
    def fn(old: float, r: float, a: float) -> tuple[float, float]:
        w = min(max(r, 1 - low), 1 + high)  # the detached weight: logp's only gradient is through logp itself
        logp = old + math.log(r)
        return -w * a * logp, -w * a
    return fn


def sapo_hand(tau_pos: float, tau_neg: float):
    def fn(old: float, r: float, a: float) -> tuple[float, float]:
        tau = tau_pos if a > 0 else tau_neg
        s = 1 / (1 + math.exp(-tau * (r - 1)))
        # d/dlogp of -(4/tau) * s * a, with dr/dlogp = r and ds/dr = tau * s * (1 - s)
        return -(4 / tau) * s * a, -4 * s * (1 - s) * r * a
    return fn


@pytest.mark.parametrize("low,high", [(0.2, 0.2), (0.2, 0.28), (1.0, 2.0)])
def test_cispo_loss_and_gradient_match_hand_computation(low, high):
    logp, old, adv, mask = batch()
    loss, info = policy_loss(logp, old, adv, mask, clip_eps_low=low, clip_eps_high=high, loss_type="cispo")
    hand = per_token(cispo_hand(low, high))
    close(loss, token_mean(hand, 0))
    loss.backward()
    close(logp.grad, grads(hand, 5))
    ratios = [r for row in TOKENS for _, r, _ in row]
    close(info["clip_fraction"], sum(not 1 - low <= r <= 1 + high for r in ratios) / 5)


def test_cispo_keeps_the_gradient_ppo_clips_away():
    """t0 (ratio 1.5 > 1.2, A > 0) and t2 (ratio 0.5 < 0.8, A < 0) get no PPO gradient but a CISPO one of
    -clip(ratio) * A / 5."""
    logp, old, adv, mask = batch()
    policy_loss(logp, old, adv, mask, loss_type="ppo")[0].backward()
    assert logp.grad[0, 0] == 0 and logp.grad[0, 2] == 0
    logp.grad = None
    policy_loss(logp, old, adv, mask, loss_type="cispo")[0].backward()
    close(logp.grad[0, [0, 2]], [-1.2 * 1.0 / 5, -0.8 * -1.0 / 5])


@pytest.mark.parametrize("tau_pos,tau_neg", [(1.0, 1.05), (0.5, 2.0)])
def test_sapo_loss_and_gradient_match_hand_computation(tau_pos, tau_neg):
    logp, old, adv, mask = batch()
    loss, info = policy_loss(logp, old, adv, mask, loss_type="sapo", tau_pos=tau_pos, tau_neg=tau_neg)
    hand = per_token(sapo_hand(tau_pos, tau_neg))
    close(loss, token_mean(hand, 0))
    loss.backward()
    close(logp.grad, grads(hand, 5))
    close(info["clip_fraction"], 0.8)  # ratios 1.5, 0.5, 0.5, 4 leave [0.8, 1.2]; only the gate acts on them


def test_sapo_is_the_policy_gradient_on_policy():
    """At ratio 1 the gate's slope is 4 s (1 - s) = 1: SAPO's gradient is -A / n, the same as PPO's, for any tau."""
    logp = torch.tensor([[-1.0, -0.3]], dtype=F64, requires_grad=True)
    adv = torch.tensor([[2.0, -0.5]], dtype=F64)
    loss, _ = policy_loss(logp, logp.detach().clone(), adv, torch.ones(1, 2), loss_type="sapo", tau_pos=3.0,
                          tau_neg=7.0)
    loss.backward()
    close(logp.grad, [[-1.0, 0.25]])


def test_sapo_and_cispo_refuse_dual_clip_and_bad_temperatures():
    logp, old, adv, mask = batch()
    for kind in ("cispo", "sapo"):
        with pytest.raises(ValueError, match="dual_clip"):
            policy_loss(logp, old, adv, mask, loss_type=kind, dual_clip=3.0)
    with pytest.raises(ValueError, match="temperatures must be > 0"):
        policy_loss(logp, old, adv, mask, loss_type="sapo", tau_neg=0.0)


def test_importance_correction_multiplies_the_cispo_and_sapo_token_losses():
    logp, old, adv, mask = batch()
    rollout = old - torch.log(torch.tensor([[0.5, 3.0, 1.0, 1.0], [1.5, 1.0, 1.0, 1.0]], dtype=F64))
    weights = [0.5, 2.0, 1.0, 1.5, 1.0]  # tis: min(exp(old - rollout), 2)
    for kind, fn in (("cispo", cispo_hand(0.2, 0.2)), ("sapo", sapo_hand(1.0, 1.05))):
        loss, _ = policy_loss(logp, old, adv, mask, loss_type=kind, rollout_logp=rollout, tis_cap=2.0)
        values = [v[0] for row in per_token(fn) for v in row]
        close(loss, sum(w * v for w, v in zip(weights, values)) / 5)
