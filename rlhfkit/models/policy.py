"""Forward passes that return per-token log-probs for padded and packed batches (see docs/CONVENTIONS.md)."""

from __future__ import annotations

import torch
from torch import nn

from rlhfkit.algorithms.sft_loss import token_logprobs


def packed_attention_mask(sample_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Block-diagonal causal additive mask [1, 1, T, T]: token t sees t' <= t of its own sample only.

    Padding tokens (sample id -1) attend only to themselves so that no row is fully masked.
    """
    ids = sample_ids[0]
    n = ids.shape[0]
    causal = torch.ones(n, n, dtype=torch.bool, device=ids.device).tril()
    allowed = causal & (ids[:, None] == ids[None, :])
    mask = torch.zeros(n, n, dtype=dtype, device=ids.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


def model_inputs(batch: dict[str, torch.Tensor], attn_implementation: str, dtype: torch.dtype) -> dict:
    """Keyword arguments for a HF forward pass from a padded or packed batch."""
    if "sample_ids" in batch:
        inputs = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"]}
        if attn_implementation != "flash_attention_2":
            inputs["attention_mask"] = packed_attention_mask(batch["sample_ids"], dtype)
        return inputs
    return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}


def model_dtype(model: nn.Module) -> torch.dtype:
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def attn_implementation_of(model: nn.Module) -> str:
    config = getattr(model, "config", None) or getattr(getattr(model, "module", None), "config", None)
    return getattr(config, "_attn_implementation", None) or "sdpa"


def forward_logits(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Logits [rows, T, vocab] for a padded or packed batch."""
    inputs = model_inputs(batch, attn_implementation_of(model), model_dtype(model))
    return model(**inputs, use_cache=False).logits


def sequence_token_logprobs(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Log-prob of each token given its prefix: [rows, T-1], entry t is log p(x_{t+1} | x_{<=t})."""
    logits = forward_logits(model, batch)
    return token_logprobs(logits[:, :-1], batch["input_ids"][:, 1:])
