"""Packed batches (`--packing_samples`): several samples in one row that do not attend to each other.

Format (docs/CONVENTIONS.md): input_ids [1, T], position_ids [1, T] restarting at 0 for every sample,
sample_ids [1, T] (0..n-1, -1 for the padding at the end), loss_mask [1, T]; no attention_mask. The model wrapper
builds the block-diagonal causal mask from sample_ids (sdpa/eager) or passes position_ids to flash-attention.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from rlhfkit.data.tokens import as_long


def pack_collate(samples: Sequence[dict[str, Any]], pad_to_multiple: int | None = None,
                 pad_id: int = 0) -> dict[str, torch.Tensor]:
    """Concatenate samples ({"input_ids", "loss_mask"}) into one row.

    The first token of every sample is never a target: in a packed row the token before it belongs to the
    previous sample, so predicting it would leak across samples. Padding (to a multiple of `pad_to_multiple`)
    goes at the end with sample id -1, positions 0.., no loss.
    """
    if not samples:
        raise ValueError("pack_collate needs at least one sample")
    ids, positions, sample_ids, masks = [], [], [], []
    for k, sample in enumerate(samples):
        x = as_long(sample["input_ids"])
        m = as_long(sample["loss_mask"]).clone()
        if m.numel() != x.numel():
            raise ValueError(f"sample {k}: loss_mask has {m.numel()} entries for {x.numel()} tokens")
        if m.numel():
            m[0] = 0
        ids.append(x)
        positions.append(torch.arange(x.numel(), dtype=torch.long))
        sample_ids.append(torch.full((x.numel(),), k, dtype=torch.long))
        masks.append(m)
    total = sum(x.numel() for x in ids)
    pad = (-total) % pad_to_multiple if pad_to_multiple else 0
    if pad:
        ids.append(torch.full((pad,), pad_id, dtype=torch.long))
        positions.append(torch.arange(pad, dtype=torch.long))
        sample_ids.append(torch.full((pad,), -1, dtype=torch.long))
        masks.append(torch.zeros(pad, dtype=torch.long))
    return {"input_ids": torch.cat(ids)[None], "position_ids": torch.cat(positions)[None],
            "sample_ids": torch.cat(sample_ids)[None], "loss_mask": torch.cat(masks)[None]}


def unpack_lengths(sample_ids: torch.Tensor) -> list[int]:
    """Token count of each sample in a packed row (padding excluded): the inverse view of pack_collate."""
    ids = sample_ids.reshape(-1)
    n = int(ids.max().item()) + 1 if ids.numel() else 0
    return torch.bincount(ids[ids >= 0], minlength=n).tolist()
