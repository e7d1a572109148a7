"""Masked reductions and loss aggregation over token tensors.

A mask is a tensor of the same shape as the values (bool, int or float holding 0/1): 1 marks a token that counts.
Every function here selects with `torch.where` instead of multiplying by the mask, so a NaN or inf sitting at a
padded position (a log-ratio of padding, say) can never leak into a result.
"""

from __future__ import annotations

import torch

from rlhfkit.config.names import AGGREGATION_MODES as AGGREGATION_MODES  # aggregate_loss dispatches on these


def _select(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """x where the mask is set, 0 elsewhere."""
    return torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of x over the positions where mask is 1 (over dim, or over everything when dim is None)."""
    selected = _select(x, mask)
    return selected.sum() if dim is None else selected.sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of x over the positions where mask is 1; an empty selection gives 0, not NaN."""
    count = mask.bool().sum() if dim is None else mask.bool().sum(dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1).to(x.dtype)


def masked_var(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Population variance (no Bessel correction) of the selected elements of x; 0 for an empty selection."""
    mean = masked_mean(x, mask)
    return masked_mean((x - mean) ** 2, mask)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, divide_std: bool = True,
                  eps: float = 1e-8) -> torch.Tensor:
    """Batch whitening of the selected elements: (x - mean) / sqrt(var + eps); masked positions become 0.

    This is the global advantage normalisation of PPO implementations (Schulman et al. 2017, "Proximal Policy
    Optimization Algorithms", as done in OpenAI baselines) and of REINFORCE++ (Hu 2025). mean and var are taken over
    every selected element of the whole tensor, var without Bessel correction.

    shift_mean=False adds the mean back after scaling (the deviations are rescaled, the mean is kept);
    divide_std=False only centres (what `--no_advantage_std_norm` asks for).
    """
    mean = masked_mean(x, mask)
    out = x - mean
    if divide_std:
        out = out * torch.rsqrt(masked_var(x, mask) + eps)
    if not shift_mean:
        out = out + mean
    return _select(out, mask)


def aggregate_loss(per_token_loss: torch.Tensor, mask: torch.Tensor, mode: str = "token_mean", *,
                   num_tokens: int | float | torch.Tensor | None = None,
                   num_seqs: int | float | torch.Tensor | None = None,
                   norm_len: int | None = None) -> torch.Tensor:
    """Reduce a per-token loss [B, T] to a scalar.

    Modes (the names used by verl/OpenRLHF configs):
    - `token_mean`: sum over every selected token / number of selected tokens. Pass `num_tokens`, the token count
      of the whole optimizer step (all micro-batches, all ranks), and the micro-batch losses summed over the step
      equal one token-level mean over the step (Yu et al. 2025, DAPO, "token-level policy gradient loss").
    - `seq_mean_token_mean`: the mean over tokens of each row, then the mean over rows (GRPO, Shao et al. 2024).
    - `seq_mean_token_sum_norm`: the sum over tokens of each row divided by the constant `norm_len`, then the mean
      over rows (Dr. GRPO, Liu et al. 2025, "Understanding R1-Zero-Like Training": no length bias). `norm_len`
      should be the generation budget (e.g. `generate_max_len`); it defaults to T, the padded length.
    For the two seq modes `num_seqs` replaces the row count of this micro-batch (rows of the whole step), and
    rows without any selected token count as rows with loss 0.
    """
    if mode not in AGGREGATION_MODES:
        raise ValueError(f"unknown loss aggregation {mode!r}; expected one of {AGGREGATION_MODES}")
    if mode == "token_mean":
        if num_seqs is not None:
            raise ValueError("aggregate_loss: num_seqs applies to the seq_* modes; token_mean takes num_tokens")
        denominator = mask.bool().sum().clamp(min=1) if num_tokens is None else num_tokens
        return masked_sum(per_token_loss, mask) / denominator
    if num_tokens is not None:
        raise ValueError(f"aggregate_loss: num_tokens applies to token_mean, not {mode}; pass num_seqs instead")
    if mode == "seq_mean_token_mean":
        per_seq = masked_mean(per_token_loss, mask, dim=-1)
    else:
        length = per_token_loss.shape[-1] if norm_len is None else norm_len
        per_seq = masked_sum(per_token_loss, mask, dim=-1) / length
    rows = per_seq.numel() if num_seqs is None else num_seqs
    return per_seq.sum() / rows
