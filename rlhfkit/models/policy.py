"""Forward passes that return per-token log-probs for padded and packed batches (see docs/CONVENTIONS.md)."""

from __future__ import annotations

import torch
from torch import nn

from rlhfkit.algorithms.sft_loss import token_logprobs
from rlhfkit.data.packing import pack_rows
from rlhfkit.models.trimmed_forward import base_model, keeps_logits, trimmed_forward


def packed_attention_mask(sample_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Block-diagonal causal additive mask [R, 1, T, T] of packed rows (sample_ids [R, T], usually R = 1): token t
    sees t' <= t of its own sample only.

    Padding tokens (sample id -1) attend only to padding so that no row is fully masked.
    """
    n = sample_ids.shape[-1]
    causal = torch.ones(n, n, dtype=torch.bool, device=sample_ids.device).tril()
    allowed = causal & (sample_ids[:, :, None] == sample_ids[:, None, :])
    mask = torch.zeros(allowed.shape, dtype=dtype, device=sample_ids.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[:, None]


def dense_rows(model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`batch` for a forward pass whose caller reduces over target tokens by sample (SFT, DPO, KTO): a right-padded
    batch re-laid out by `pack_rows` into fewer rows of the same width when that drops rows (the padding of
    short-answer batches is 10-30% of the tokens), else `batch` itself. Same log-probs: every sample keeps its
    positions and sees only itself. Left alone: packed batches, batches with images (their M-RoPE positions
    follow the rows), flash-attention (it reads one packed row) and
    mixture-of-experts models (their router loss counts every row's tokens)."""
    inner = getattr(model, "module", model)
    config = getattr(inner, "config", None)
    if ("sample_ids" in batch or "pixel_values" in batch or "attention_mask" not in batch or "loss_mask" not in batch
            or attn_implementation_of(inner) not in ("sdpa", "eager") or hasattr(config, "output_router_logits")):
        return batch
    return pack_rows(batch) or batch


def model_inputs(batch: dict[str, torch.Tensor], attn_implementation: str, dtype: torch.dtype) -> dict:
    """Keyword arguments for a HF forward pass from a padded or packed batch, with its images' `pixel_values` and
    `image_grid_thw` when it has some (`rlhfkit.models.vision` adds their M-RoPE positions)."""
    images = {k: batch[k] for k in ("pixel_values", "image_grid_thw") if k in batch}
    if "sample_ids" in batch:
        inputs = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"]}
        if attn_implementation != "flash_attention_2":
            inputs["attention_mask"] = packed_attention_mask(batch["sample_ids"], dtype)
        return {**inputs, **images}
    return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"], **images}


def model_dtype(model: nn.Module) -> torch.dtype:
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def attn_implementation_of(model: nn.Module) -> str:
    config = getattr(model, "config", None) or getattr(getattr(model, "module", None), "config", None)
    return getattr(config, "_attn_implementation", None) or "sdpa"


def first_target_position(batch: dict[str, torch.Tensor]) -> int:
    """The first position whose logits a loss on `loss_mask` reads (logits[:, p] predict token p + 1): the
    prompt columns before it that no row of a padded batch predicts need no LM head and no log-softmax (with
    ~500-token prompts and short answers, nearly all of them). 0 for a packed batch."""
    if "sample_ids" in batch:
        return 0
    cols = batch["loss_mask"][:, 1:].any(dim=0).nonzero()
    return int(cols[0]) if cols.numel() else 0


def from_position(batch: dict[str, torch.Tensor], start: int) -> dict[str, torch.Tensor]:
    """input_ids, loss_mask (and sample_ids) from column `start` on, aligned with `forward_logits(.., start)`."""
    return {k: batch[k][:, start:] for k in ("input_ids", "loss_mask", "sample_ids") if k in batch}


def keep_logits_from(model: nn.Module, batch: dict[str, torch.Tensor], start: int) -> dict[str, int]:
    """Forward-pass kwargs that run the LM head from position `start` on only (Hugging Face's `logits_to_keep`),
    where the model takes it: {} otherwise. Either way `logits[:, start - T:]` are the logits from `start` on."""
    if start <= 0 or not keeps_logits(type(base_model(model)).forward):
        return {}
    return {"logits_to_keep": batch["input_ids"].shape[1] - start}


def forward_logits(model: nn.Module, batch: dict[str, torch.Tensor], start: int = 0) -> torch.Tensor:
    """Logits [rows, T - start, vocab] for a padded or packed batch, from position `start` on (with start > 0 the
    last decoder layer and the LM head run from `start` on only: `trimmed_forward`)."""
    inputs = model_inputs(batch, attn_implementation_of(model), model_dtype(model))
    if start > 0:
        keep = torch.arange(start, batch["input_ids"].shape[1])  # on the host: trimmed_forward reads it as a slice
        return trimmed_forward(model, keep, **inputs, use_cache=False)
    return model(**inputs, use_cache=False).logits


def sequence_token_logprobs(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Log-prob of each token given its prefix: [rows, T-1], entry t is log p(x_{t+1} | x_{<=t})."""
    logits = forward_logits(model, batch)
    return token_logprobs(logits[:, :-1], batch["input_ids"][:, 1:])
