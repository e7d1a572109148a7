"""Masked reductions and loss aggregation against hand-computed numbers."""

from __future__ import annotations

import math

import pytest
import torch

from rlhfkit.algorithms.masking import aggregate_loss, masked_mean, masked_sum, masked_var, masked_whiten

NAN = float("nan")


def close(actual: torch.Tensor, expected, tol: float = 1e-9) -> None:
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=tol, rtol=0)


@pytest.fixture
def batch() -> tuple[torch.Tensor, torch.Tensor]:
    # Selected values 1, 2, 3 | 4, 5; NaN and garbage sit at padded positions and must not leak.
    x = torch.tensor([[1.0, 2.0, 3.0, NAN], [4.0, 5.0, 100.0, NAN]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    return x, mask


def test_masked_sum_and_mean(batch):
    x, mask = batch
    close(masked_sum(x, mask), 15.0)              # 1+2+3+4+5
    close(masked_mean(x, mask), 3.0)              # 15 / 5
    close(masked_sum(x, mask, dim=-1), [6.0, 9.0])
    close(masked_mean(x, mask, dim=-1), [2.0, 4.5])  # 6/3, 9/2
    close(masked_mean(x, torch.zeros_like(mask)), 0.0)  # empty selection: 0, not NaN


def test_masked_var_is_population_variance(batch):
    x, mask = batch
    close(masked_var(x, mask), 2.0)  # deviations from 3: -2,-1,0,1,2 -> (4+1+0+1+4)/5


def test_masked_whiten(batch):
    x, mask = batch
    s = math.sqrt(2.0)  # std of 1..5 (population)
    close(masked_whiten(x, mask, eps=0.0), [[-2 / s, -1 / s, 0.0, 0.0], [1 / s, 2 / s, 0.0, 0.0]])
    # shift_mean=False keeps the mean 3: (x - 3)/sqrt(2) + 3
    close(masked_whiten(x, mask, shift_mean=False, eps=0.0),
          [[3 - 2 / s, 3 - 1 / s, 3.0, 0.0], [3 + 1 / s, 3 + 2 / s, 0.0, 0.0]])
    # divide_std=False only centres
    close(masked_whiten(x, mask, divide_std=False), [[-2.0, -1.0, 0.0, 0.0], [1.0, 2.0, 0.0, 0.0]])
    # constant values: 0 everywhere, no NaN
    same = torch.full((2, 4), 0.7, dtype=torch.float64)
    assert torch.equal(masked_whiten(same, mask), torch.zeros(2, 4, dtype=torch.float64))


def test_aggregate_loss_modes(batch):
    loss, mask = batch
    close(aggregate_loss(loss, mask, "token_mean"), 3.0)                    # 15 / 5 tokens
    close(aggregate_loss(loss, mask, "token_mean", num_tokens=10), 1.5)     # 15 / 10 tokens of the step
    close(aggregate_loss(loss, mask, "seq_mean_token_mean"), 3.25)          # (6/3 + 9/2) / 2
    close(aggregate_loss(loss, mask, "seq_mean_token_mean", num_seqs=4), 1.625)  # (2 + 4.5) / 4
    close(aggregate_loss(loss, mask, "seq_mean_token_sum_norm"), 1.875)     # (6/4 + 9/4) / 2, norm_len = T = 4
    close(aggregate_loss(loss, mask, "seq_mean_token_sum_norm", norm_len=10), 0.75)  # (0.6 + 0.9) / 2


def test_token_mean_over_the_step_from_micro_batches(batch):
    loss, mask = batch
    # Two micro-batches (one row each) with the step's token count 5 sum to the token mean of the step: 6/5 + 9/5.
    parts = [aggregate_loss(loss[i:i + 1], mask[i:i + 1], "token_mean", num_tokens=5) for i in range(2)]
    close(parts[0], 1.2)
    close(sum(parts), aggregate_loss(loss, mask, "token_mean"))


def test_aggregate_loss_gradient_ignores_padding(batch):
    loss, mask = batch
    loss = loss.clone().requires_grad_(True)
    aggregate_loss(loss, mask, "token_mean").backward()
    close(loss.grad, [[0.2, 0.2, 0.2, 0.0], [0.2, 0.2, 0.0, 0.0]])  # d/dx of sum/5


def test_aggregate_loss_rejects_bad_arguments(batch):
    loss, mask = batch
    with pytest.raises(ValueError, match="unknown loss aggregation"):
        aggregate_loss(loss, mask, "sum")
    with pytest.raises(ValueError, match="num_seqs"):
        aggregate_loss(loss, mask, "token_mean", num_seqs=3)
    with pytest.raises(ValueError, match="num_tokens"):
        aggregate_loss(loss, mask, "seq_mean_token_mean", num_tokens=3)
