"""Reward shaping against hand-computed numbers."""

from __future__ import annotations

import pytest
import torch

from rlhfkit.algorithms.rewards import (
    clip_rewards,
    compute_token_rewards,
    grouped,
    groups_in_range,
    last_action_index,
    length_penalty,
    normalize_rewards,
    stop_properly_penalty,
)


def close(actual: torch.Tensor, expected, tol: float = 1e-9) -> None:
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=tol, rtol=0)


def test_clip_and_normalize():
    close(clip_rewards(torch.tensor([-12.0, 3.0, 15.0]), 10.0), [-10.0, 3.0, 10.0])
    close(normalize_rewards(torch.tensor([1.0, 3.0]), mean=2.0, std=4.0), [-0.25, 0.25])  # (1-2)/4, (3-2)/4
    with pytest.raises(ValueError):
        clip_rewards(torch.zeros(2), 0.0)


def test_dapo_soft_overlong_penalty():
    lengths = torch.tensor([10, 16, 18, 20, 25])
    # max_len 20, buffer 4 -> free up to 16; (16 - L)/4 in (16, 20]; -1 beyond 20
    close(length_penalty(lengths, max_len=20, buffer_len=4), [0.0, 0.0, -0.5, -1.0, -1.0])
    close(length_penalty(lengths, max_len=20, buffer_len=4, penalty_factor=0.5), [0.0, 0.0, -0.25, -0.5, -0.5])
    with pytest.raises(ValueError, match="buffer"):
        length_penalty(lengths, max_len=20, buffer_len=30)


def test_token_rewards_reward_on_last_action_token_and_kl_everywhere():
    final = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    kl = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.5, 9.0, 0.5, 9.0], [7.0, 7.0, 7.0, 7.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0],   # right padding
                         [1, 0, 1, 0],   # a hole (environment token) in the middle
                         [0, 0, 0, 0]])  # no action at all
    assert last_action_index(mask).tolist() == [2, 2, 0]
    out = compute_token_rewards(final, kl, mask, kl_coef=0.1)
    close(out, [[-0.01, -0.02, -0.03 + 1.0, 0.0],
                [-0.05, 0.0, -0.05 + 2.0, 0.0],
                [0.0, 0.0, 0.0, 0.0]])
    close(compute_token_rewards(final, None, mask), [[0, 0, 1.0, 0], [0, 0, 2.0, 0], [0, 0, 0, 0]])


def test_groups():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    assert grouped(rewards, 4).shape == (2, 4)
    assert groups_in_range(rewards, 4, 0.0, 2.0).tolist() == [True, False]  # means 0.75 and 2.0
    with pytest.raises(ValueError, match="n_samples_per_prompt=3"):
        grouped(rewards, 3)


def test_overlong_and_stop_properly_penalties_match_float64_reference():
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 41, (64,), generator=gen)
    rewards = torch.randn(64, generator=gen, dtype=torch.float64)
    truncated = torch.rand(64, generator=gen) < 0.3
    max_len, buffer, factor = 40, 12, 0.7

    def overlong(length: int) -> float:  # DAPO, Yu et al. 2025, eq. 13
        if length <= max_len - buffer:
            return 0.0
        if length <= max_len:
            return (max_len - buffer - length) / buffer * factor
        return -factor

    expected = [overlong(int(n)) for n in lengths]
    close(length_penalty(lengths, max_len, buffer, factor).double(), expected, tol=1e-6)
    for coef in (0.0, 0.25, -0.5):
        want = [(r * coef if coef >= 0 else coef) if t else r for r, t in zip(rewards.tolist(), truncated.tolist())]
        close(stop_properly_penalty(rewards, truncated, coef), want, tol=1e-12)
    with pytest.raises(ValueError, match="<= 1"):
        stop_properly_penalty(rewards, truncated, 1.5)


def test_groups_in_range_keeps_open_interval():
    scores = torch.tensor([1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.5, 0.5])
    assert groups_in_range(scores, 2, 0.0, 1.0).tolist() == [False, False, True, True, True]
    assert groups_in_range(scores, 2, 0.4, 0.6).tolist() == [False, False, True, True, True]
    assert groups_in_range(scores, 2, 0.5, 1.0).tolist() == [False, False, False, False, False]
