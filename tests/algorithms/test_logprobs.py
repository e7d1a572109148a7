"""Chunked token log-probs (custom backward) and entropy against hand values and plain torch."""

from __future__ import annotations

import math

import torch

from rlhfkit.algorithms.logprobs import entropy_from_logits, token_logprobs

F64 = torch.float64


def close(actual: torch.Tensor, expected, tol: float = 1e-9) -> None:
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=tol, rtol=0)


def reference(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.to(F64), dim=-1).gather(-1, labels[..., None]).squeeze(-1)


def test_hand_computed():
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [1.0, 2.0, 3.0, 0.0]]], dtype=F64)
    out = token_logprobs(logits, torch.tensor([[2, 2]]))
    # uniform over 4: -ln 4; 3 - ln(e + e^2 + e^3 + 1)
    close(out, [[-math.log(4), 3 - math.log(math.e + math.e ** 2 + math.e ** 3 + 1)]])


def test_matches_log_softmax_for_every_chunking_and_layout():
    torch.manual_seed(0)
    full = torch.randn(3, 7, 11, dtype=F64)
    labels = torch.randint(0, 11, (3, 7))
    for chunk in (1, 3, 13, None):  # 13: blocks of two whole 6-position rows, then one row
        # contiguous, and the non-flattenable causal slice logits[:, :-1]
        close(token_logprobs(full, labels, chunk), reference(full, labels), tol=1e-12)
        close(token_logprobs(full[:, :-1], labels[:, 1:], chunk), reference(full[:, :-1], labels[:, 1:]), tol=1e-12)
        close(token_logprobs(full[0], labels[0], chunk), reference(full[0], labels[0]), tol=1e-12)


def test_gradient_matches_autograd_and_passes_gradcheck():
    torch.manual_seed(1)
    full = torch.randn(2, 5, 6, dtype=F64, requires_grad=True)
    labels = torch.randint(0, 6, (2, 4))
    weights = torch.randn(2, 4, dtype=F64)
    (token_logprobs(full[:, :-1], labels, chunk_size=3) * weights).sum().backward()
    mine = full.grad.clone()
    full.grad = None
    (token_logprobs(full[:, :-1], labels, chunk_size=8) * weights).sum().backward()  # both rows in one block
    close(full.grad, mine, tol=1e-12)
    full.grad = None
    (reference(full[:, :-1], labels) * weights).sum().backward()
    close(mine, full.grad, tol=1e-12)
    assert torch.autograd.gradcheck(lambda z: token_logprobs(z, labels, 2), (full[:, :-1].detach().clone()
                                                                               .requires_grad_(True),))


def test_ignored_labels_give_zero_and_no_gradient():
    logits = torch.randn(1, 3, 5, dtype=F64, requires_grad=True)
    labels = torch.tensor([[1, -100, 4]])
    out = token_logprobs(logits, labels)
    assert out[0, 1] == 0
    out.sum().backward()
    assert torch.equal(logits.grad[0, 1], torch.zeros(5, dtype=F64))
    close(out[0, 2], reference(logits[0, 2], torch.tensor(4)), tol=1e-12)


def test_bf16_logits_give_float32_exact_for_the_rounded_logits():
    torch.manual_seed(2)
    logits = (torch.randn(2, 4, 50) * 3).to(torch.bfloat16).requires_grad_(True)
    labels = torch.randint(0, 50, (2, 4))
    out = token_logprobs(logits, labels)
    assert out.dtype == torch.float32
    close(out, reference(logits.detach(), labels).float(), tol=1e-5)
    out.sum().backward()
    assert logits.grad.dtype == torch.bfloat16


def test_entropy():
    logits = torch.tensor([[0.0, 0.0, -math.inf], [0.0, math.log(3.0), -math.inf]], dtype=F64, requires_grad=True)
    out = entropy_from_logits(logits)
    # ln 2; p = (1/4, 3/4): -(0.25 ln 0.25 + 0.75 ln 0.75) = 0.5623351446; the -inf logit adds 0
    close(out, [math.log(2.0), 0.5623351446188083])
    out.sum().backward()
    assert torch.isfinite(logits.grad).all()
    torch.manual_seed(3)
    full = torch.randn(2, 5, 7, dtype=F64)
    p = torch.softmax(full[:, :-1], dim=-1)
    for chunk in (2, 4, None):  # spans of a row, one row per block, both rows in one block
        close(entropy_from_logits(full[:, :-1], chunk_size=chunk), -(p * p.log()).sum(-1), tol=1e-12)
