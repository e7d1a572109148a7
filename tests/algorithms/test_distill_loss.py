"""On-policy distillation losses against hand computations in float64: values and gradients."""

from __future__ import annotations

import math

import pytest
import torch

from rlhfkit.algorithms.distill_loss import reverse_kl_loss, topk_forward_kl_loss

F64 = torch.float64
NAN = float("nan")


def close(actual: torch.Tensor, expected, tol: float = 1e-12) -> None:
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=tol, rtol=0)


def test_reverse_kl_value_gradient_and_metric():
    """Three real tokens (log-ratios 0.5, -1.0, 2.0) and two padded ones holding NaN (an agent's feedback token
    or padding): loss = mean(0.5 r^2) = (0.125 + 0.5 + 2.0) / 3; d/dlogp = r / 3; metric = mean(r) = 0.5."""
    logp = torch.tensor([[-1.0, -2.0, NAN], [-0.5, NAN, -3.0]], dtype=F64, requires_grad=True)
    teacher = torch.tensor([[-1.5, -1.0, 0.0], [-2.5, 7.0, NAN]], dtype=F64)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    loss, info = reverse_kl_loss(logp, teacher, mask)
    close(loss, (0.125 + 0.5 + 2.0) / 3)
    close(info["reverse_kl"], 0.5)
    loss.backward()
    close(logp.grad, [[0.5 / 3, -1.0 / 3, 0.0], [2.0 / 3, 0.0, 0.0]])


def test_reverse_kl_sequence_mean_aggregation():
    """seq_mean_token_mean: row 1 mean(0.125, 0.5) = 0.3125, row 2 2.0 -> (0.3125 + 2.0) / 2."""
    logp = torch.tensor([[-1.0, -2.0], [-0.5, 0.0]], dtype=F64)
    teacher = torch.tensor([[-1.5, -1.0], [-2.5, 0.0]], dtype=F64)
    loss, _ = reverse_kl_loss(logp, teacher, torch.tensor([[1, 1], [1, 0]]), agg="seq_mean_token_mean")
    close(loss, (0.3125 + 2.0) / 2)


def test_reverse_kl_gradient_is_the_sampled_kl_gradient():
    """Averaged over every token y of a small vocabulary, weighted by pi_s(y), the loss's gradient is the exact
    gradient of KL(pi_s || pi_t) with respect to the student's logits (the estimator is unbiased on-policy)."""
    z = torch.tensor([0.3, -1.2, 0.8, 0.0], dtype=F64, requires_grad=True)
    teacher = torch.log_softmax(torch.tensor([1.0, 0.5, -0.7, 0.2], dtype=F64), dim=0)
    student = torch.log_softmax(z, dim=0)
    probs = student.exp().detach()
    expected = torch.autograd.grad((student.exp() * (student - teacher)).sum(), z, retain_graph=True)[0]
    estimate = torch.zeros_like(z)
    for y in range(4):
        loss, _ = reverse_kl_loss(student[y].reshape(1, 1), teacher[y].reshape(1, 1), torch.ones(1, 1))
        estimate += probs[y] * torch.autograd.grad(loss, z, retain_graph=True)[0]
    close(estimate, expected)


def test_topk_forward_kl_value_and_gradient():
    """Vocabulary 3, k 2. Teacher top-2 log-probs log 0.6 and log 0.2 renormalise to q = (0.75, 0.25) on tokens
    2 and 0; student logits (0, 0, log 2) give pi_s = (0.25, 0.25, 0.5). Loss = 0.75 log(0.75 / 0.5) + 0.25
    log(0.25 / 0.25); d/dz = pi_s - q scattered = (0.25 - 0.25, 0.25, 0.5 - 0.75). The padded position counts
    nothing."""
    logits = torch.tensor([[[0.0, 0.0, math.log(2.0)], [5.0, NAN, 1.0]]], dtype=F64, requires_grad=True)
    ids = torch.tensor([[[2, 0], [0, 1]]])
    teacher = torch.tensor([[[math.log(0.6), math.log(0.2)], [NAN, -1.0]]], dtype=F64)
    mask = torch.tensor([[1, 0]])
    loss, info = topk_forward_kl_loss(logits, ids, teacher, mask)
    expected = 0.75 * math.log(0.75 / 0.5)
    close(loss, expected)
    close(info["topk_forward_kl"], expected)
    close(info["teacher_topk_mass"], 0.8)
    loss.backward()
    close(logits.grad[0, 0], [0.0, 0.25, -0.25])
    close(logits.grad[0, 1], [0.0, 0.0, 0.0])


def test_topk_forward_kl_is_zero_when_the_student_matches_the_kept_tokens():
    logits = torch.log(torch.tensor([[[0.75, 0.25, 1e-30]]], dtype=F64))
    loss, _ = topk_forward_kl_loss(logits, torch.tensor([[[0, 1]]]), torch.log(torch.tensor([[[0.3, 0.1]]],
                                   dtype=F64)), torch.ones(1, 1))
    close(loss, 0.0, tol=1e-12)


def test_shape_mismatches_raise():
    with pytest.raises(ValueError, match="one shape"):
        reverse_kl_loss(torch.zeros(2, 3), torch.zeros(2, 2), torch.ones(2, 3))
    with pytest.raises(ValueError, match="disagree"):
        topk_forward_kl_loss(torch.zeros(1, 2, 5), torch.zeros(1, 2, 3, dtype=torch.long), torch.zeros(1, 2, 2),
                             torch.ones(1, 2))
