"""SFT loss on padded and packed batches against hand-computed numbers."""

from __future__ import annotations

import math

import pytest
import torch

from rlhfkit.algorithms.sft_loss import sft_loss, shifted_target_mask

F64 = torch.float64
LN3 = math.log(3.0)


def close(actual: torch.Tensor, expected, tol: float = 1e-9) -> None:
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=tol, rtol=0)


def padded_batch():
    """Vocab 2. Row 0: targets at t=2 (token 1) and t=3 (token 0); row 1: target at t=1 (token 1), then padding.

    logits[:, t] predicts input_ids[:, t+1]:
      row 0: logits[0,1] = [0, ln 3] -> p(1) = 3/4, nll = -ln 0.75 = 0.2876820725
             logits[0,2] = [0, 0]    -> p(0) = 1/2, nll = ln 2 = 0.6931471806
      row 1: logits[1,0] = [ln 3, 0] -> p(1) = 1/4, nll = ln 4 = 1.3862943611
    """
    input_ids = torch.tensor([[0, 1, 1, 0], [1, 1, 0, 0]])
    loss_mask = torch.tensor([[0, 0, 1, 1], [0, 1, 0, 0]])
    logits = torch.full((2, 4, 2), 7.0, dtype=F64)  # 7 = anything; only the positions above matter
    logits[0, 1] = torch.tensor([0.0, LN3], dtype=F64)
    logits[0, 2] = torch.tensor([0.0, 0.0], dtype=F64)
    logits[1, 0] = torch.tensor([LN3, 0.0], dtype=F64)
    return logits, input_ids, loss_mask


NLL = (-math.log(0.75), math.log(2.0), math.log(4.0))


def test_padded_reductions():
    logits, ids, mask = padded_batch()
    close(sft_loss(logits, ids, mask), sum(NLL) / 3)            # 2.3671236142 / 3 = 0.7890412047
    close(sft_loss(logits, ids, mask, "sum"), sum(NLL))
    close(sft_loss(logits, ids, mask, num_tokens=6), sum(NLL) / 6)  # token count of the whole step
    close(sft_loss(logits, ids, mask, "per_sample"), [(NLL[0] + NLL[1]) / 2, NLL[2]])  # 0.4904146265, 1.3862943611


def test_gradient_flows_only_to_target_positions():
    logits, ids, mask = padded_batch()
    logits.requires_grad_(True)
    sft_loss(logits, ids, mask).backward()
    # d(-log p_label)/dz = softmax - onehot, / 3 tokens; row 0 pos 1: ([1/4, 3/4] - [0, 1]) / 3
    close(logits.grad[0, 1], [0.25 / 3, -0.25 / 3])
    assert torch.equal(logits.grad[0, 0], torch.zeros(2, dtype=F64))
    assert torch.equal(logits.grad[:, 3], torch.zeros(2, 2, dtype=F64))


def test_packed_batch_per_sample_and_boundaries():
    # Two samples packed in one row plus one padding token: [s0: 0 1 1 | s1: 1 1 | pad]
    input_ids = torch.tensor([[0, 1, 1, 1, 1, 0]])
    sample_ids = torch.tensor([[0, 0, 0, 1, 1, -1]])
    # loss_mask wrongly set at the first token of s1 and at padding: neither may count
    loss_mask = torch.tensor([[0, 1, 1, 1, 1, 1]])
    assert shifted_target_mask(loss_mask, sample_ids).tolist() == [[True, True, False, True, False]]
    logits = torch.zeros(1, 6, 2, dtype=F64)
    logits[0, 0] = torch.tensor([0.0, LN3], dtype=F64)  # predicts token 1: nll = -ln 0.75
    logits[0, 1] = torch.tensor([LN3, 0.0], dtype=F64)  # predicts token 1: nll = ln 4
    logits[0, 3] = torch.tensor([0.0, 0.0], dtype=F64)  # predicts token 1: nll = ln 2
    s0, s1 = (-math.log(0.75) + math.log(4.0)) / 2, math.log(2.0)
    close(sft_loss(logits, input_ids, loss_mask, "per_sample", sample_ids=sample_ids), [s0, s1])
    close(sft_loss(logits, input_ids, loss_mask, sample_ids=sample_ids),
          (-math.log(0.75) + math.log(4.0) + math.log(2.0)) / 3)


def test_bad_reduction():
    logits, ids, mask = padded_batch()
    with pytest.raises(ValueError, match="reduction"):
        sft_loss(logits, ids, mask, "max")
