"""Next-token cross-entropy for supervised fine-tuning, on the batch formats of docs/CONVENTIONS.md.

`loss_mask[t] = 1` marks token t as a target, predicted from positions < t: the loss uses logits[:, :-1] against
input_ids[:, 1:] masked by loss_mask[:, 1:]. `token_logprobs` (logprobs.py) is re-exported here.
"""

from __future__ import annotations

import torch

from rlhfkit.algorithms.logprobs import token_logprobs as token_logprobs  # the log-likelihood of each target
from rlhfkit.algorithms.masking import masked_mean, masked_sum
from rlhfkit.config.names import SFT_REDUCTIONS as SFT_REDUCTIONS  # sft_loss dispatches on these


def shifted_target_mask(loss_mask: torch.Tensor, sample_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Bool [rows, T-1]: entry t says whether input_ids[:, t+1] is a target predicted from logits[:, t].

    For a packed batch (sample_ids given) a token is never predicted across a sample boundary, and padding
    (sample id -1) is never a target, whatever the loss mask says.
    """
    mask = loss_mask[:, 1:].bool()
    if sample_ids is not None:
        owner = sample_ids[:, 1:]
        mask = mask & (owner == sample_ids[:, :-1]) & (owner >= 0)
    return mask


def sft_loss(logits: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor, reduction: str = "mean",
             *, sample_ids: torch.Tensor | None = None,
             num_tokens: int | float | torch.Tensor | None = None) -> torch.Tensor:
    """Negative log-likelihood of the target tokens (maximum-likelihood LM training, Radford et al. 2018).

    logits [rows, T, V], input_ids and loss_mask [rows, T] (padded, or packed with sample_ids [1, T]).
    - `mean`: sum of -log p over target tokens / number of target tokens. Pass num_tokens, the target count of the
      whole optimizer step, to make micro-batches sum to the token mean of the step.
    - `sum`: the sum of -log p over target tokens.
    - `per_sample`: the mean -log p of each sample: [rows] for a padded batch; [number of samples] for a packed
      batch, indexed by sample id (sample ids number the samples of the whole batch). A sample without targets
      gives 0.
    """
    if reduction not in SFT_REDUCTIONS:
        raise ValueError(f"unknown SFT loss reduction {reduction!r}; expected one of {SFT_REDUCTIONS}")
    mask = shifted_target_mask(loss_mask, sample_ids)
    nll = -token_logprobs(logits[:, :-1], input_ids[:, 1:])
    if reduction == "sum":
        return masked_sum(nll, mask)
    if reduction == "mean":
        denominator = mask.sum().clamp(min=1) if num_tokens is None else num_tokens
        return masked_sum(nll, mask) / denominator
    if sample_ids is None:
        return masked_mean(nll, mask, dim=-1)
    owner = sample_ids[:, 1:].reshape(-1)
    flat_mask = mask.reshape(-1)
    num_samples = int(sample_ids.max().item()) + 1
    if num_samples <= 0:
        return nll.new_zeros(0)
    owner = torch.where(flat_mask, owner, 0)
    sums = torch.zeros(num_samples, dtype=nll.dtype, device=nll.device)
    sums = sums.index_add(0, owner, torch.where(flat_mask, nll.reshape(-1), torch.zeros((), dtype=nll.dtype,
                                                                                          device=nll.device)))
    counts = torch.zeros(num_samples, dtype=nll.dtype, device=nll.device).index_add(0, owner, flat_mask.to(nll.dtype))
    return sums / counts.clamp(min=1)
