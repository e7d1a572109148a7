"""Reward-model, DPO/cDPO/IPO, NLL and KTO losses: hand-computed numbers, and an independent float64
implementation (plain math, one element at a time) on random inputs."""

from __future__ import annotations

import math
import random

import pytest
import torch

from rlhfkit.algorithms.preference_losses import (
    dpo_loss,
    kto_kl_reference_point,
    kto_loss,
    nll_loss,
    pairwise_rm_loss,
)

F64 = torch.float64


def close(actual: torch.Tensor, expected, tol: float = 1e-9) -> None:
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=tol, rtol=0)


def t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=F64)


# -- the independent reference: plain Python floats ----------------------------------------------------------------
def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


def log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def mean(values: list[float]) -> float:
    return math.fsum(values) / len(values)


def rand(rng: random.Random, n: int, scale: float) -> list[float]:
    return [rng.uniform(-scale, scale) for _ in range(n)]


# -- reward model ----------------------------------------------------------------------------------------------------
def test_rm_loss_hand_computed():
    chosen, rejected = t([2.0]), t([1.0])
    close(pairwise_rm_loss(chosen, rejected), 0.31326168751822286)            # -log sigmoid(1) = log(1 + e^-1)
    close(pairwise_rm_loss(chosen, rejected, kind="logexp"), 0.31326168751822286)
    close(pairwise_rm_loss(chosen, rejected, margin=0.5), 0.4740769841801067)  # log(1 + e^-0.5)
    close(pairwise_rm_loss(chosen, rejected, margin=0.5, kind="logexp"), 0.4740769841801067)
    with pytest.raises(ValueError, match="unknown reward-model loss"):
        pairwise_rm_loss(chosen, rejected, kind="hinge")


def test_rm_loss_against_float64_reference():
    rng = random.Random(0)
    chosen, rejected, margin = rand(rng, 64, 30.0), rand(rng, 64, 30.0), rand(rng, 64, 3.0)
    sig_plain = mean([-log_sigmoid(c - r) for c, r in zip(chosen, rejected)])
    sig_margin = mean([-log_sigmoid(c - r - m) for c, r, m in zip(chosen, rejected, margin)])
    logexp_plain = mean([math.log1p(math.exp(r - c)) for c, r in zip(chosen, rejected)])
    logexp_margin = mean([math.log1p(math.exp(r - c + m)) for c, r, m in zip(chosen, rejected, margin)])
    close(pairwise_rm_loss(t(chosen), t(rejected)), sig_plain, tol=1e-6)
    close(pairwise_rm_loss(t(chosen), t(rejected), t(margin)), sig_margin, tol=1e-6)
    close(pairwise_rm_loss(t(chosen), t(rejected), kind="logexp"), logexp_plain, tol=1e-6)
    close(pairwise_rm_loss(t(chosen), t(rejected), t(margin), kind="logexp"), logexp_margin, tol=1e-6)
    per_pair = pairwise_rm_loss(t(chosen), t(rejected), reduction="none")
    close(per_pair, [-log_sigmoid(c - r) for c, r in zip(chosen, rejected)], tol=1e-6)


# -- DPO family --------------------------------------------------------------------------------------------------
# chosen log-ratio = -1 - (-2) = 1; rejected log-ratio = -3 - (-2.5) = -0.5; h = 1.5
HAND = (t([-1.0]), t([-3.0]), t([-2.0]), t([-2.5]))


def test_dpo_hand_computed():
    loss, chosen_rewards, rejected_rewards = dpo_loss(*HAND, beta=0.1)
    close(loss, 0.620957047789532)  # -log sigmoid(0.15) = log(1 + e^-0.15)
    close(chosen_rewards, [0.1])    # 0.1 * 1
    close(rejected_rewards, [-0.05])  # 0.1 * -0.5
    # cDPO: 0.9 * log(1 + e^-0.15) + 0.1 * log(1 + e^0.15) = 0.620957 + 0.1 * 0.15
    loss, _, _ = dpo_loss(*HAND, beta=0.1, label_smoothing=0.1)
    close(loss, 0.635957047789532)
    loss, _, _ = dpo_loss(*HAND, beta=0.1, ipo=True)
    close(loss, 12.25)  # (1.5 - 1/(2*0.1))^2 = (1.5 - 5)^2


def reference_dpo(pc, pr, rc, rr, beta, eps, ipo):
    losses = []
    for a, b, c, d in zip(pc, pr, rc, rr):
        h = (a - c) - (b - d)
        if ipo:
            losses.append((h - 1.0 / (2.0 * beta)) ** 2)
        else:
            losses.append(-(1.0 - eps) * log_sigmoid(beta * h) - eps * log_sigmoid(-beta * h))
    return mean(losses), [beta * (a - c) for a, c in zip(pc, rc)], [beta * (b - d) for b, d in zip(pr, rr)]


def test_dpo_ipo_cdpo_against_float64_reference():
    rng = random.Random(1)
    inputs = [[rng.uniform(-300.0, -5.0) for _ in range(32)] for _ in range(4)]
    for beta, eps, ipo in ((0.1, 0.0, False), (0.5, 0.0, False), (0.1, 0.2, False), (0.1, 0.0, True),
                           (1.0, 0.0, True)):
        loss, chosen_rewards, rejected_rewards = dpo_loss(*(t(x) for x in inputs), beta=beta, label_smoothing=eps,
                                                          ipo=ipo)
        ref_loss, ref_chosen, ref_rejected = reference_dpo(*inputs, beta, eps, ipo)
        close(loss, ref_loss, tol=1e-6)
        close(chosen_rewards, ref_chosen, tol=1e-6)
        close(rejected_rewards, ref_rejected, tol=1e-6)


def test_dpo_gradient_and_errors():
    pc = t([-1.0]).requires_grad_(True)
    loss, chosen_rewards, _ = dpo_loss(pc, *HAND[1:], beta=0.1)
    loss.backward()
    close(pc.grad, [-0.1 * (1 - 0.5374298453437496)])  # d/dpc = -beta * (1 - sigmoid(0.15))
    assert not chosen_rewards.requires_grad
    with pytest.raises(ValueError, match="IPO has no label smoothing"):
        dpo_loss(*HAND, beta=0.1, label_smoothing=0.1, ipo=True)
    with pytest.raises(ValueError, match="label_smoothing"):
        dpo_loss(*HAND, beta=0.1, label_smoothing=0.5)


def test_nll_term():
    close(nll_loss(t([-3.0, -2.0]), torch.tensor([3, 4])), 0.75)  # (3/3 + 2/4) / 2
    rng = random.Random(2)
    sums, lengths = [rng.uniform(-500, -1) for _ in range(16)], [rng.randint(1, 300) for _ in range(16)]
    close(nll_loss(t(sums), torch.tensor(lengths)), mean([-s / n for s, n in zip(sums, lengths)]), tol=1e-6)


# -- KTO ---------------------------------------------------------------------------------------------------------
def test_kto_hand_computed():
    # r = [-1 - (-1.5), -2 - (-1)] = [0.5, -1]; z0 = 0.2; beta = 0.5
    # desirable: 1 - sigmoid(0.5 * 0.3) = 0.4625701547; undesirable: 2 * (1 - sigmoid(0.5 * 1.2)) = 0.7086873875
    loss, rewards = kto_loss(t([-1.0, -2.0]), t([-1.5, -1.0]), torch.tensor([True, False]), 0.2, beta=0.5,
                             desirable_weight=1.0, undesirable_weight=2.0)
    close(loss, 0.5856287711023298)  # (0.4625701547 + 0.7086873875) / 2
    close(rewards, [0.25, -0.5])
    # a negative reference point is clamped to 0: 1 - sigmoid(0.25), 2 * (1 - sigmoid(0.5))
    loss, _ = kto_loss(t([-1.0, -2.0]), t([-1.5, -1.0]), torch.tensor([1, 0]), t(-3.0), beta=0.5,
                       undesirable_weight=2.0)
    close(loss, ((1 - sigmoid(0.25)) + 2 * (1 - sigmoid(0.5))) / 2)


def test_kto_against_float64_reference():
    rng = random.Random(3)
    policy, ref = rand(rng, 40, 50.0), rand(rng, 40, 50.0)
    labels = [rng.random() < 0.4 for _ in range(40)]
    kl_policy, kl_ref = rand(rng, 40, 50.0), rand(rng, 40, 50.0)
    z0 = max(mean([a - b for a, b in zip(kl_policy, kl_ref)]), 0.0)
    z0_mine = kto_kl_reference_point(t(kl_policy), t(kl_ref))
    close(z0_mine, z0, tol=1e-6)
    for beta, wd, wu in ((0.1, 1.0, 1.0), (0.5, 1.0, 1.33), (2.0, 0.7, 1.0)):
        expected = mean([wd * (1 - sigmoid(beta * (p - r - z0))) if good else wu * (1 - sigmoid(beta * (z0 - p + r)))
                         for p, r, good in zip(policy, ref, labels)])
        loss, rewards = kto_loss(t(policy), t(ref), torch.tensor(labels), z0_mine, beta, wd, wu)
        close(loss, expected, tol=1e-6)
        close(rewards, [beta * (p - r) for p, r in zip(policy, ref)], tol=1e-6)


def test_kto_reference_point_is_clamped_and_detached():
    policy = t([-1.0, 0.5]).requires_grad_(True)
    z0 = kto_kl_reference_point(policy, t([-1.5, 0.2]))
    close(z0, 0.4)  # mean(0.5, 0.3)
    assert not z0.requires_grad
    close(kto_kl_reference_point(t([-2.0]), t([-1.0])), 0.0)  # mean -1 -> clamped to 0
