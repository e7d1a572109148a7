"""SimPO and ORPO: loss and gradients in float64 against hand computations written here with `math`."""

from __future__ import annotations

import math

import pytest
import torch

from rlhfkit.algorithms.preference_losses import log_odds, orpo_loss, simpo_loss

F64 = torch.float64
# per-token mean log-probs of three pairs (chosen, rejected): one ordered, one reversed, one near certainty
CHOSEN = [-0.4, -1.3, -0.05]
REJECTED = [-0.9, -0.7, -2.5]


def close(actual: torch.Tensor, expected, tol: float = 1e-12) -> None:
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=tol, rtol=0)


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def inputs():
    return (torch.tensor(CHOSEN, dtype=F64, requires_grad=True), torch.tensor(REJECTED, dtype=F64,
                                                                               requires_grad=True))


@pytest.mark.parametrize("beta,gamma", [(2.0, 0.5), (0.1, 0.0), (10.0, 1.6)])
def test_simpo_loss_gradients_and_rewards(beta, gamma):
    chosen, rejected = inputs()
    loss, chosen_rewards, rejected_rewards = simpo_loss(chosen, rejected, beta, gamma)
    n = len(CHOSEN)
    z = [beta * (c - r) - gamma for c, r in zip(CHOSEN, REJECTED)]
    close(loss, sum(math.log1p(math.exp(-x)) for x in z) / n)  # -log sigmoid(z) = log(1 + e^-z)
    loss.backward()
    # d/dz of log(1 + e^-z) = -sigmoid(-z); dz/dchosen = beta, dz/drejected = -beta
    close(chosen.grad, [-beta * sigmoid(-x) / n for x in z])
    close(rejected.grad, [beta * sigmoid(-x) / n for x in z])
    close(chosen_rewards, [beta * c for c in CHOSEN])
    close(rejected_rewards, [beta * r for r in REJECTED])
    assert not chosen_rewards.requires_grad


def hand_log_odds(a: float) -> float:
    p = math.exp(a)
    return math.log(p) - math.log1p(-p)


@pytest.mark.parametrize("lam", [0.1, 1.0])
def test_orpo_loss_and_gradients(lam):
    chosen, rejected = inputs()
    loss, chosen_rewards, _ = orpo_loss(chosen, rejected, lam)
    n = len(CHOSEN)
    d = [hand_log_odds(c) - hand_log_odds(r) for c, r in zip(CHOSEN, REJECTED)]
    close(loss, sum(-c + lam * math.log1p(math.exp(-x)) for c, x in zip(CHOSEN, d)) / n)
    loss.backward()
    # d log odds(a) / da = 1 + e^a / (1 - e^a) = 1 / (1 - e^a); the NLL term adds -1 to the chosen side
    close(chosen.grad, [(-1 - lam * sigmoid(-x) / (1 - math.exp(c))) / n for c, x in zip(CHOSEN, d)])
    close(rejected.grad, [lam * sigmoid(-x) / (1 - math.exp(r)) / n for r, x in zip(REJECTED, d)])
    close(chosen_rewards, [lam * c for c in CHOSEN])


def test_log_odds_is_accurate_on_both_branches_and_finite_at_certainty():
    a = torch.tensor([-1e-3, -0.5, -0.7, -3.0, -40.0], dtype=F64)
    close(log_odds(a), [hand_log_odds(x) for x in a.tolist()], tol=1e-9)
    sure = torch.tensor([0.0, -1e-9], dtype=torch.float32, requires_grad=True)
    out = log_odds(sure)
    out.sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(sure.grad).all()


def test_bad_temperatures_raise():
    chosen, rejected = inputs()
    with pytest.raises(ValueError, match="beta must be > 0"):
        simpo_loss(chosen, rejected, 0.0, 0.5)
    with pytest.raises(ValueError, match="lambda must be > 0"):
        orpo_loss(chosen, rejected, -1.0)
