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


def pack_padded(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Pack the rows of a right-padded batch ([B, T], docs/CONVENTIONS.md) into one packed row.

    Returns the packed batch (input_ids, position_ids, sample_ids; no loss_mask: the RL roles select their
    positions themselves) and `offsets [B]`, where row i starts in the packed row: position t of row i is packed
    position offsets[i] + t (`packed_index`). Only real tokens are kept, so no compute goes to padding.
    """
    lengths = attention_mask.long().sum(dim=1)
    keep = attention_mask.bool()
    rows = torch.arange(input_ids.shape[0], device=input_ids.device)
    sample_ids = rows[:, None].expand_as(input_ids)[keep]
    position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)[None, :].expand_as(input_ids)[keep]
    offsets = torch.cumsum(lengths, dim=0) - lengths
    batch = {"input_ids": input_ids[keep][None], "position_ids": position_ids[None], "sample_ids": sample_ids[None]}
    return batch, offsets


def packed_index(offsets: torch.Tensor, positions: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Packed-row index [B, R] of padded positions [B, R] (each clamped into its own row, so an index never points
    into a neighbouring sample, even where the caller masks the result out)."""
    last = (lengths - 1).clamp(min=0)[:, None]
    return offsets[:, None] + torch.minimum(positions.clamp(min=0), last)


# pack_rows' cost of a row of width W: W token-rows of matmuls plus W^2 attention pairs, an attention pair costing
# about 1/ATTENTION_PAIRS_PER_TOKEN of a token's matmuls (2 x hidden vs ~12 x hidden^2 multiply-adds; counted
# generously for a small model, as the masked attention kernel is less efficient than the matmuls).
ATTENTION_PAIRS_PER_TOKEN = 2048


def _first_fit_decreasing(sizes: list[int], width: int) -> tuple[list[int], list[tuple[int, int]]]:
    """Row fill levels and (row, start) of every sample, longest first into the first row with room."""
    fill: list[int] = []
    where: list[tuple[int, int]] = [(0, 0)] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        r = next((r for r, used in enumerate(fill) if used + sizes[i] <= width), len(fill))
        if r == len(fill):
            fill.append(0)
        where[i] = (r, fill[r])
        fill[r] += sizes[i]
    return fill, where


def pack_rows(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
    """The samples of a right-padded batch ([B, T]: input_ids, attention_mask, loss_mask) re-laid out first-fit
    decreasing into R < B rows of width W >= T (the R and W cheapest by matmul rows + attention pairs): the
    packed format with R rows (input_ids, position_ids, sample_ids, loss_mask [R, W]; sample id = the sample's row
    in the padded batch, -1 padding). Padding then costs (almost) no matmul rows.

    None when that saves nothing, or when the batch is not right-padded (a row's mask is not 1..1 0..0)."""
    mask = batch["attention_mask"]
    rows, width = mask.shape
    lengths = mask.sum(dim=1)
    if rows < 2 or not bool((mask == (torch.arange(width, device=mask.device) < lengths[:, None])).all()):
        return None
    sizes = lengths.tolist()

    def cost(n_rows: int, w: int) -> float:
        return n_rows * w * (1 + w / ATTENTION_PAIRS_PER_TOKEN)

    best, best_cost = None, cost(rows, width)
    for n_rows in range(1, rows):  # the narrowest rows that hold the batch in n_rows, by bisection on the width
        lo, hi = max(width, -(-sum(sizes) // n_rows)), max(width, sum(sizes))
        if cost(n_rows, lo) >= best_cost:
            continue
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if len(_first_fit_decreasing(sizes, mid)[0]) <= n_rows else (mid + 1, hi)
        fill, where = _first_fit_decreasing(sizes, lo)
        if cost(len(fill), lo) < best_cost:
            best, best_cost = (lo, fill, where), cost(len(fill), lo)
    if best is None:
        return None
    width, fill, where = best
    device = mask.device
    out = {"input_ids": torch.zeros(len(fill), width, dtype=torch.long, device=device),
           "position_ids": torch.arange(width, device=device).repeat(len(fill), 1),
           "sample_ids": torch.full((len(fill), width), -1, dtype=torch.long, device=device),
           "loss_mask": torch.zeros(len(fill), width, dtype=torch.long, device=device)}
    for i, (r, start) in enumerate(where):
        n = sizes[i]
        out["input_ids"][r, start:start + n] = batch["input_ids"][i, :n]
        out["position_ids"][r, start:start + n] = torch.arange(n, device=device)
        out["sample_ids"][r, start:start + n] = i
        out["loss_mask"][r, start:start + n] = batch["loss_mask"][i, :n]
        out["loss_mask"][r, start] = 0  # never predicted across a sample boundary (as pack_collate)
    for r, used in enumerate(fill):  # padding positions restart at 0, as pack_collate's
        out["position_ids"][r, used:] = torch.arange(width - used, device=device)
    return out
