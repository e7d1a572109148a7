"""Padded batches and the pair/unpaired batch builders the trainers use.

Padded format (docs/CONVENTIONS.md): input_ids [B, T] right-padded with pad_id, attention_mask [B, T] (1 = real
token), loss_mask [B, T] (1 = target; 0 on padding). All int64. Each builder also packs (`packing=True`) into the
format of `rlhfkit.data.packing.pack_collate`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch

from rlhfkit.data.packing import pack_collate
from rlhfkit.data.tokens import as_long, prompt_response_sample

Batch = dict[str, torch.Tensor]
PIXEL_KEYS = ("pixel_values", "image_grid_thw")  # a vision-language sample's images (rlhfkit.data.images)


def pad_collate(samples: Sequence[dict[str, Any]], pad_id: int, pad_to_multiple: int | None = None) -> Batch:
    """Right-pad samples ({"input_ids", "loss_mask"}) into [B, T] tensors (T rounded up to `pad_to_multiple`)."""
    if not samples:
        raise ValueError("pad_collate needs at least one sample")
    rows = [(as_long(s["input_ids"]), as_long(s["loss_mask"])) for s in samples]
    width = max(x.numel() for x, _ in rows)
    if pad_to_multiple:
        width += (-width) % pad_to_multiple
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    loss_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for b, (x, m) in enumerate(rows):
        if m.numel() != x.numel():
            raise ValueError(f"sample {b}: loss_mask has {m.numel()} entries for {x.numel()} tokens")
        input_ids[b, : x.numel()] = x
        attention_mask[b, : x.numel()] = 1
        loss_mask[b, : x.numel()] = m
    return {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask}


def collate_samples(samples: Sequence[dict[str, Any]], pad_id: int, packing: bool = False,
                    pad_to_multiple: int | None = None) -> Batch:
    """pad_collate or pack_collate, by `--packing_samples`; the rows' images (if any) in row order."""
    if packing:  # images in sample order too: the model reads each sample's M-RoPE positions from its own images
        return with_pixels(pack_collate(samples, pad_to_multiple, pad_id=pad_id), samples)
    return with_pixels(pad_collate(samples, pad_id, pad_to_multiple), samples)


def pixels_of(sample: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The image tensors of a sample ({} for a text-only one)."""
    return {k: sample[k] for k in PIXEL_KEYS if k in sample}


def with_pixels(batch: Batch, rows: Sequence[dict[str, Any]]) -> Batch:
    """`batch` plus the rows' images concatenated in row order (Qwen2-VL's layout: patches of every image one after
    another, `image_grid_thw` one line per image) and `mm_token_type_ids` (1 on vision tokens) when there are any."""
    pixels = [pixels_of(r) for r in rows if "pixel_values" in r]
    if pixels:
        for key in PIXEL_KEYS:
            batch[key] = torch.cat([p[key] for p in pixels])
    return batch


def make_collate(pad_id: int, packing: bool = False, pad_to_multiple: int | None = None
                 ) -> Callable[[Sequence[dict[str, Any]]], Batch]:
    """A one-argument collate function for SFT-style samples."""
    return partial(collate_samples, pad_id=pad_id, packing=packing, pad_to_multiple=pad_to_multiple)


def pair_collate(pairs: Sequence[dict[str, Any]], pad_id: int, packing: bool = False,
                 pad_to_multiple: int | None = None) -> Batch:
    """Preference pairs ({"prompt_ids", "chosen_ids", "rejected_ids", "margin"}) as ONE batch of 2B rows:
    rows 0..B-1 are prompt+chosen, rows B..2B-1 prompt+rejected (packed: samples in that order), loss_mask on
    the response tokens; plus "margin" float32 [B]. One forward pass scores both sides."""
    chosen = [{**prompt_response_sample(p["prompt_ids"], p["chosen_ids"]), **pixels_of(p)} for p in pairs]
    rejected = [{**prompt_response_sample(p["prompt_ids"], p["rejected_ids"]), **pixels_of(p)} for p in pairs]
    batch = collate_samples(chosen + rejected, pad_id, packing, pad_to_multiple)
    batch["margin"] = torch.tensor([float(p.get("margin", 0.0)) for p in pairs], dtype=torch.float32)
    return batch


def unpaired_collate(samples: Sequence[dict[str, Any]], pad_id: int, packing: bool = False,
                     pad_to_multiple: int | None = None, kl_rows: bool = False, max_len: int | None = None
                     ) -> Batch:
    """KTO samples ({"prompt_ids", "response_ids", "label"}) as a batch of B rows plus "labels" int64 [B]
    (1 desirable, 0 undesirable). With `kl_rows`, B more rows follow: prompt i with the response of sample
    i-1 (mod B), the mismatched pairs KTO uses to estimate its KL reference point (Ethayarajh et al., 2024),
    cut to `max_len`."""
    rows = [{**prompt_response_sample(s["prompt_ids"], s["response_ids"]), **pixels_of(s)} for s in samples]
    if kl_rows:
        n = len(samples)
        rows += [{**prompt_response_sample(samples[i]["prompt_ids"], samples[(i - 1) % n]["response_ids"], max_len),
                  **pixels_of(samples[i])} for i in range(n)]
    batch = collate_samples(rows, pad_id, packing, pad_to_multiple)
    batch["labels"] = torch.tensor([int(s["label"]) for s in samples], dtype=torch.long)
    return batch
