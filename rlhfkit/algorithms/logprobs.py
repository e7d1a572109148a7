"""Per-token quantities from logits: the log-probability of given tokens and the entropy, memory-aware.

Logits of a causal LM are [B, T, V] with V up to ~150k, often in bf16. A float32 log_softmax of the whole tensor
doubles (bf16 -> fp32) the largest activation of the step and autograd keeps it until backward. Here float32 work
is done over chunks of positions, and the log-prob gradient is recomputed chunk by chunk in backward from the
logits themselves (which autograd keeps anyway) and one float32 logsumexp per position.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.autograd.function import once_differentiable

# Positions per chunk are chosen so that one float32 chunk holds about 2**26 numbers (256 MiB).
CHUNK_ELEMENTS = 2**26


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _as_rows(logits: torch.Tensor) -> torch.Tensor:
    """A [rows, positions, V] view of logits, without copying when possible.

    logits[:, :-1] of a [B, T, V] tensor cannot be flattened to [B * (T-1), V] without a copy, so it stays
    [B, T-1, V] and is walked row by row; a tensor that can be flattened becomes one row.
    """
    vocab = logits.shape[-1]
    try:
        return logits.view(1, -1, vocab)
    except RuntimeError:
        return logits if logits.dim() == 3 else logits.reshape(-1, logits.shape[-2], vocab)


def _chunks(rows: int, positions: int, chunk_size: int) -> Iterator[tuple[slice, slice]]:
    """(rows, positions) blocks of at most `chunk_size` positions in all: blocks of whole rows when a row fits (the
    [16, 127, V] logits[:, :-1] of an SFT micro-batch is one block, not 16 small ones whose every op pays a thread
    pool start and a copy), else one row at a time in spans of positions."""
    if positions <= chunk_size:
        per_block = max(1, chunk_size // max(positions, 1))
        for row in range(0, rows, per_block):
            yield slice(row, min(row + per_block, rows)), slice(0, positions)
        return
    for row in range(rows):
        for start in range(0, positions, chunk_size):
            yield slice(row, row + 1), slice(start, min(start + chunk_size, positions))


def _chunk_size(vocab: int, chunk_size: int | None) -> int:
    return max(1, CHUNK_ELEMENTS // max(vocab, 1)) if chunk_size is None else chunk_size


class _TokenLogProbs(torch.autograd.Function):
    """log p(label) = z[label] - logsumexp(z); backward: d/dz = g * (onehot(label) - softmax(z))."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, chunk_size: int) -> torch.Tensor:
        dtype = _compute_dtype(logits.dtype)
        rows = _as_rows(logits)
        labels = labels.reshape(rows.shape[:2])
        valid = labels >= 0
        safe_labels = labels.clamp(min=0)
        out = torch.empty(rows.shape[:2], dtype=dtype, device=logits.device)
        lse = torch.empty_like(out)
        for row, span in _chunks(rows.shape[0], rows.shape[1], chunk_size):
            z = rows[row, span].to(dtype)
            lse[row, span] = torch.logsumexp(z, dim=-1)
            out[row, span] = z.gather(-1, safe_labels[row, span, None]).squeeze(-1) - lse[row, span]
        out = torch.where(valid, out, torch.zeros((), dtype=dtype, device=out.device))
        ctx.save_for_backward(logits, safe_labels, valid, lse)
        ctx.chunk_size = chunk_size
        return out.reshape(logits.shape[:-1])

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
        logits, safe_labels, valid, lse = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None
        dtype = lse.dtype
        rows = _as_rows(logits)
        g = torch.where(valid, grad_out.reshape(valid.shape).to(dtype), torch.zeros((), dtype=dtype,
                                                                                   device=lse.device))
        grad = torch.empty(rows.shape, dtype=logits.dtype, device=logits.device)
        for row, span in _chunks(rows.shape[0], rows.shape[1], ctx.chunk_size):
            g_chunk = g[row, span, None]
            chunk = torch.exp(rows[row, span].to(dtype) - lse[row, span, None]).mul_(-g_chunk)
            chunk.scatter_add_(-1, safe_labels[row, span, None], g_chunk)
            grad[row, span] = chunk
        return grad.reshape(logits.shape), None, None


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor, chunk_size: int | None = None) -> torch.Tensor:
    """log softmax(logits)[label] at every position: logits [..., V], labels [...] -> [...] in float32.

    The log-likelihood of maximum-likelihood LM training (Radford et al. 2018, GPT) and the per-token log-probs of
    every RL and preference loss. Exact (logsumexp in float32, or float64 for float64 logits). A label < 0 (e.g.
    -100) gives 0 and no gradient. Memory: float32 work happens over chunks of `chunk_size` positions (default:
    about 256 MiB of float32 per chunk) in forward and in backward; nothing of size V is saved for backward
    besides the logits. Not twice differentiable.
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"token_logprobs: logits {tuple(logits.shape)} and labels {tuple(labels.shape)} "
                         "disagree on the leading dimensions")
    return _TokenLogProbs.apply(logits, labels, _chunk_size(logits.shape[-1], chunk_size))


def entropy_from_logits(logits: torch.Tensor, chunk_size: int | None = None) -> torch.Tensor:
    """Entropy of the softmax distribution at every position: H = -sum_v p_v log p_v, p = softmax(logits).

    The entropy bonus of PPO (Schulman et al. 2017, "Proximal Policy Optimization Algorithms") and the entropy
    metric of RL for LLMs. float32 work is done over chunks of positions (as in token_logprobs); with gradients
    enabled autograd keeps each chunk's float32 log-softmax, so call it under torch.no_grad() for a metric.
    Returns logits.shape[:-1] in float32 (float64 for float64 input). A -inf logit contributes 0.
    """
    dtype = _compute_dtype(logits.dtype)
    rows = _as_rows(logits)
    size = _chunk_size(logits.shape[-1], chunk_size)
    zero = torch.zeros((), dtype=dtype, device=logits.device)
    pieces = []
    for row, span in _chunks(rows.shape[0], rows.shape[1], size):
        log_probs = torch.log_softmax(rows[row, span].to(dtype), dim=-1)
        probs = log_probs.exp()
        # p = 0 (a -inf logit) must give 0, not 0 * -inf = NaN, in the value and in the gradient.
        pieces.append(-(probs * torch.where(probs > 0, log_probs, zero)).sum(dim=-1).reshape(-1))
    if not pieces:
        return torch.zeros(logits.shape[:-1], dtype=dtype, device=logits.device)
    return torch.cat(pieces).reshape(logits.shape[:-1])
