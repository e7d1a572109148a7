"""Advantage estimators against hand-computed numbers and a plain Python reverse loop."""

from __future__ import annotations

import math
import random

import pytest
import torch

from rlhfkit.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    compute_advantages,
    discounted_returns,
    gae_advantages_and_returns,
    group_baseline,
)

F64 = torch.float64


def close(actual: torch.Tensor, expected, tol: float = 1e-9) -> None:
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=tol, rtol=0)


# -- GAE and returns ----------------------------------------------------------------------------------------------
def test_gae_hand_computed():
    values = torch.tensor([[0.5, 1.0, 2.0, 9.0]], dtype=F64)
    rewards = torch.tensor([[0.0, 0.0, 1.0, 5.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 1, 0]])
    adv, ret = gae_advantages_and_returns(values, rewards, mask, gamma=0.9, lambd=0.8)
    # t=2: delta = 1 + 0.9*0 - 2 = -1;         A2 = -1
    # t=1: delta = 0 + 0.9*2 - 1 = 0.8;        A1 = 0.8 + 0.72*(-1) = 0.08
    # t=0: delta = 0 + 0.9*1 - 0.5 = 0.4;      A0 = 0.4 + 0.72*0.08 = 0.4576
    close(adv, [[0.4576, 0.08, -1.0, 0.0]])
    close(ret, [[0.4576 + 0.5, 0.08 + 1.0, -1.0 + 2.0, 0.0]])


def reference_gae(values, rewards, mask, gamma, lambd):
    """Plain Python reverse loop over the action steps of each row (masked positions are not steps)."""
    advantages, returns = [], []
    for v_row, r_row, m_row in zip(values, rewards, mask):
        adv_row = [0.0] * len(v_row)
        steps = [t for t, m in enumerate(m_row) if m]
        next_value, running = 0.0, 0.0
        for t in reversed(steps):
            delta = r_row[t] + gamma * next_value - v_row[t]
            running = delta + gamma * lambd * running
            adv_row[t] = running
            next_value = v_row[t]
        advantages.append(adv_row)
        returns.append([a + v if m else 0.0 for a, v, m in zip(adv_row, v_row, m_row)])
    return advantages, returns


def random_mask(rng: random.Random, rows: int, length: int) -> list[list[int]]:
    masks = []
    for _ in range(rows):
        start, end = sorted(rng.sample(range(length + 1), 2))  # left and right padding
        row = [1 if start <= t < end else 0 for t in range(length)]
        for t in range(start, end):  # holes
            if rng.random() < 0.2:
                row[t] = 0
        masks.append(row)
    return masks


def test_gae_matches_python_loop_on_random_inputs():
    rng = random.Random(0)
    for gamma, lambd in ((1.0, 1.0), (0.99, 0.95), (0.5, 0.0)):
        values = [[rng.gauss(0, 1) for _ in range(9)] for _ in range(6)]
        rewards = [[rng.gauss(0, 1) for _ in range(9)] for _ in range(6)]
        mask = random_mask(rng, 6, 9)
        adv, ret = gae_advantages_and_returns(torch.tensor(values, dtype=F64), torch.tensor(rewards, dtype=F64),
                                              torch.tensor(mask), gamma, lambd)
        ref_adv, ref_ret = reference_gae(values, rewards, mask, gamma, lambd)
        close(adv, ref_adv, tol=1e-12)
        close(ret, ref_ret, tol=1e-12)


def test_discounted_returns_hand_computed():
    rewards = torch.tensor([[1.0, 2.0, 3.0, 7.0], [1.0, 9.0, 2.0, 4.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 1, 1]])
    # row 0: G2 = 3; G1 = 2 + 0.5*3 = 3.5; G0 = 1 + 0.5*3.5 = 2.75
    # row 1 (hole at 1): G3 = 4; G2 = 2 + 0.5*4 = 4; G0 = 1 + 0.5*4 = 3
    close(discounted_returns(rewards, mask, gamma=0.5), [[2.75, 3.5, 3.0, 0.0], [3.0, 0.0, 4.0, 4.0]])


def test_gae_with_lambda_one_is_returns_minus_values():
    rng = random.Random(1)
    mask = torch.tensor(random_mask(rng, 4, 7))
    values, rewards = torch.randn(4, 7, dtype=F64), torch.randn(4, 7, dtype=F64)
    adv, _ = gae_advantages_and_returns(values, rewards, mask, gamma=0.9, lambd=1.0)
    close(adv, (discounted_returns(rewards, mask, 0.9) - values) * mask, tol=1e-12)


# -- group baselines ----------------------------------------------------------------------------------------------
REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0,     # mean 0.5, sample std sqrt(1/3)
                        0.7, 0.7, 0.7, 0.7,     # identical: exactly 0, never NaN
                        3.0, 1.0, 2.0, 6.0],    # mean 3, sample std sqrt(14/3) = 2.1602468995
                       dtype=F64)


def test_group_norm():
    out = group_baseline(REWARDS, 4, "group_norm", eps=0.0)
    s = 2.160246899469287
    close(out, [0.5 * math.sqrt(3), -0.5 * math.sqrt(3), -0.5 * math.sqrt(3), 0.5 * math.sqrt(3),  # 0.5/sqrt(1/3)
                0.0, 0.0, 0.0, 0.0,
                0.0, -2 / s, -1 / s, 3 / s])
    assert torch.equal(out[4:8], torch.zeros(4, dtype=F64))
    # --no_advantage_std_norm: only the mean is subtracted
    close(group_baseline(REWARDS, 4, "group_norm", std_norm=False),
          [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0, 0.0, -2.0, -1.0, 3.0])


def test_dr_grpo_and_reinforce_baseline_subtract_the_mean():
    expected = [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0, 0.0, -2.0, -1.0, 3.0]
    close(group_baseline(REWARDS, 4, "dr_grpo"), expected)
    close(group_baseline(REWARDS, 4, "reinforce_baseline"), expected)


def test_rloo_leave_one_out():
    out = group_baseline(REWARDS, 4, "rloo")
    # r0 = 1 - mean(0, 0, 1) = 2/3; r1 = 0 - mean(1, 0, 1) = -2/3; r11 = 6 - mean(3, 1, 2) = 4; r9 = 1 - 11/3
    close(out, [2 / 3, -2 / 3, -2 / 3, 2 / 3, 0, 0, 0, 0, 0.0, 1 - 11 / 3, 2 - 10 / 3, 4.0])
    # = n/(n-1) * (r - mean)
    close(out, 4 / 3 * group_baseline(REWARDS, 4, "dr_grpo"))


def test_identical_rewards_give_exact_zero_for_every_method():
    same = torch.full((6,), 0.1, dtype=torch.float32)  # 0.1 is not exactly representable; its mean may round
    for method in ("group_norm", "dr_grpo", "reinforce_baseline", "rloo"):
        out = group_baseline(same, 3, method, eps=0.0)
        assert torch.equal(out, torch.zeros(6)), method


def test_group_baseline_rejects_bad_groups():
    with pytest.raises(ValueError, match="at least 2 samples"):
        group_baseline(REWARDS, 1, "rloo")
    with pytest.raises(ValueError, match="whole groups"):
        group_baseline(REWARDS, 5, "group_norm")
    with pytest.raises(ValueError, match="unknown group baseline"):
        group_baseline(REWARDS, 4, "gae")


# -- compute_advantages ---------------------------------------------------------------------------------------------
# Two prompts x 2 samples, T = 3; KL 5.0 at padded positions must be ignored.
RL_MASK = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]])
RL_KL = torch.tensor([[0.1, 0.2, 0.1], [0.3, 0.1, 5.0], [0.2, 5.0, 5.0], [0.0, 0.1, 0.2]], dtype=F64)
RL_REWARDS = torch.tensor([1.0, 0.0, 2.0, 2.0], dtype=F64)


def rl(estimator: str, **kwargs):
    args = dict(rewards=RL_REWARDS, action_mask=RL_MASK, token_kl=RL_KL, n_samples_per_prompt=2, gamma=1.0,
                kl_coef=0.5, group_eps=0.0)
    args.update(kwargs)
    return compute_advantages(estimator, **args)


def test_group_norm_with_kl_in_reward():
    adv, ret = rl("group_norm")
    g = 1 / math.sqrt(2)  # group [1, 0]: (r - 0.5) / std, std = sqrt(0.5); group [2, 2]: 0
    # token rewards: -0.5*kl everywhere, the normalised reward added on the last token; returns = suffix sums
    expected = [[-0.05 - 0.1 - 0.05 + g, -0.1 - 0.05 + g, -0.05 + g],
                [-0.15 - 0.05 - g, -0.05 - g, 0.0],
                [-0.1, 0.0, 0.0],
                [0.0 - 0.05 - 0.1, -0.05 - 0.1, -0.1]]
    close(ret, expected)
    close(adv, expected)  # group-relative estimators are not whitened


def test_group_norm_with_kl_loss_keeps_kl_out_of_the_reward():
    adv, _ = rl("group_norm", use_kl_loss=True)
    g = 1 / math.sqrt(2)
    close(adv, [[g, g, g], [-g, -g, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])


def test_rloo_and_dr_grpo():
    adv, _ = rl("rloo", use_kl_loss=True)
    close(adv, [[1.0, 1.0, 1.0], [-1.0, -1.0, 0.0], [0, 0, 0], [0, 0, 0]])  # 1 - 0, 0 - 1; identical group 0
    adv, _ = rl("dr_grpo", use_kl_loss=True)
    close(adv, [[0.5, 0.5, 0.5], [-0.5, -0.5, 0.0], [0, 0, 0], [0, 0, 0]])


def test_reinforce_whitens_the_returns_over_the_batch():
    adv, ret = rl("reinforce")
    # token rewards: row0 [-0.05, -0.1, -0.05+1]; row1 [-0.15, -0.05+0]; row2 [-0.1+2]; row3 [0, -0.05, -0.1+2]
    close(ret, [[0.8, 0.85, 0.95], [-0.2, -0.05, 0.0], [1.9, 0.0, 0.0], [1.85, 1.85, 1.9]])
    # 9 tokens: mean = 9.85/9 = 1.0944444, population var = 0.6213580; adv = (ret - mean)/sqrt(var + 1e-8)
    close(adv, [[-0.3735359495984136, -0.3101053166477396, -0.18324405074639158],
                [-1.6421486086118944, -1.4518567097598722, 0.0],
                [1.021937975316415, 0.0, 0.0],
                [0.9585073423657413, 0.9585073423657413, 1.021937975316415]])
    adv, _ = rl("reinforce", std_norm=False)  # --no_advantage_std_norm: centred only
    m = 9.85 / 9
    close(adv, [[0.8 - m, 0.85 - m, 0.95 - m], [-0.2 - m, -0.05 - m, 0.0], [1.9 - m, 0.0, 0.0],
                [1.85 - m, 1.85 - m, 1.9 - m]])


def test_reinforce_baseline_subtracts_group_mean_then_whitens():
    _, ret = rl("reinforce_baseline")
    # scalar rewards after the group mean: [0.5, -0.5, 0, 0]
    expected_returns = [[-0.2 + 0.5, -0.15 + 0.5, -0.05 + 0.5], [-0.2 - 0.5, -0.05 - 0.5, 0.0],
                        [-0.1, 0.0, 0.0], [-0.15, -0.15, -0.1]]
    close(ret, expected_returns)
    adv, _ = rl("reinforce_baseline")
    flat = [0.3, 0.35, 0.45, -0.7, -0.55, -0.1, -0.15, -0.15, -0.1]
    m = sum(flat) / 9
    s = math.sqrt(sum((x - m) ** 2 for x in flat) / 9 + 1e-8)
    close(adv[RL_MASK.bool()], [(x - m) / s for x in flat])


def test_gae_entry_point():
    values = torch.tensor([[0.5, 0.25], [0.1, -0.2]], dtype=F64)
    mask = torch.ones(2, 2, dtype=torch.long)
    adv, ret = compute_advantages("gae", rewards=torch.tensor([1.0, 0.0], dtype=F64), action_mask=mask,
                                  values=values, gamma=1.0, lambd=1.0)
    # gamma = lambda = 1: A = G - V = [[1-0.5, 1-0.25], [0-0.1, 0+0.2]] = [[0.5, 0.75], [-0.1, 0.2]]
    close(ret, [[1.0, 1.0], [0.0, 0.0]])  # returns = A + V, not whitened
    # whitened: mean 1.35/4 = 0.3375, var (0.1625^2 + 0.4125^2 + 0.4375^2 + 0.1375^2)/4 = 0.10171875
    close(adv, [[0.5095101460402084, 1.2933719091789904], [-1.3717580854928684, -0.43112396972632994]])


def test_compute_advantages_errors_and_no_nan():
    with pytest.raises(ValueError, match="unknown advantage estimator"):
        rl("ppo")
    with pytest.raises(ValueError, match="critic"):
        rl("gae")
    all_same = torch.full((4,), 0.3, dtype=F64)
    for estimator in ADVANTAGE_ESTIMATORS:
        values = torch.zeros(4, 3, dtype=F64) if estimator == "gae" else None
        adv, ret = rl(estimator, rewards=all_same, values=values, kl_coef=0.0)
        assert torch.isfinite(adv).all() and torch.isfinite(ret).all(), estimator
