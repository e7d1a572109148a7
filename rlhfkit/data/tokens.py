"""Token-level helpers shared by the datasets: encoding without surprises, bos/eos, and loss-masked samples.

Every dataset tokenises the pieces of a sample (prompt, response, each chat turn) separately and concatenates
the ids. That keeps the prompt/response boundary on a token boundary (no BPE merge across it), so the loss mask
is exact. Special tokens are never added by the tokenizer itself: bos and eos are added here, explicitly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

Piece = tuple[list[int], bool]  # (token ids, are they targets of the loss)


def encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids of `text`, special tokens written in the text recognised, none added."""
    return list(tokenizer.encode(text, add_special_tokens=False)) if text else []


def with_bos(tokenizer: Any, ids: list[int]) -> list[int]:
    """Prepend bos when the tokenizer has one and the ids do not start with it already."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None or (ids and ids[0] == bos):
        return ids
    return [bos, *ids]


def with_eos(tokenizer: Any, ids: list[int], anywhere: bool = False) -> list[int]:
    """Append eos unless the ids end with it (or, for chat-template turns, `anywhere`: contain it, because a
    template closes a turn with its own end token followed perhaps by a newline)."""
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None or (ids and ids[-1] == eos) or (anywhere and eos in ids):
        return ids
    return [*ids, eos]


def join_pieces(pieces: Sequence[Piece]) -> tuple[list[int], list[int]]:
    """Concatenate pieces into (input_ids, loss_mask). Position 0 is never a target (nothing predicts it), which
    also keeps packed samples from being predicted across their boundary."""
    ids: list[int] = []
    mask: list[int] = []
    for piece_ids, is_target in pieces:
        ids.extend(piece_ids)
        mask.extend([int(is_target)] * len(piece_ids))
    if mask:
        mask[0] = 0
    return ids, mask


def first_target(mask: Sequence[int]) -> int | None:
    """Index of the first target token, None if there is none."""
    for t, m in enumerate(mask):
        if m:
            return t
    return None


def as_long(values: Any) -> torch.Tensor:
    """A 1-D int64 tensor from a list or tensor (no copy for int64 tensors)."""
    if isinstance(values, torch.Tensor):
        return values.to(torch.long).reshape(-1)
    return torch.tensor(list(values), dtype=torch.long)


def token_sample(ids: Sequence[int], mask: Sequence[int]) -> dict[str, torch.Tensor]:
    """The per-sample format every collate function takes: {"input_ids": [L], "loss_mask": [L]}, int64."""
    return {"input_ids": as_long(ids), "loss_mask": as_long(mask)}


def prompt_response_sample(prompt_ids: Any, response_ids: Any, max_len: int | None = None) -> dict[str, torch.Tensor]:
    """prompt + response as one sample, loss on the response; the response is cut to fit `max_len`."""
    prompt = as_long(prompt_ids)
    response = as_long(response_ids)
    if max_len is not None:
        response = response[: max(max_len - prompt.numel(), 0)]
    mask = torch.cat([torch.zeros_like(prompt), torch.ones_like(response)])
    if mask.numel():
        mask[0] = 0
    return {"input_ids": torch.cat([prompt, response]), "loss_mask": mask}


def sources_of(records: Sequence[Any], limit: int = 3) -> str:
    """The distinct source files of some records, for messages: `a.jsonl, b.jsonl`."""
    seen: list[str] = []
    for r in records:
        s = getattr(r, "source", None)
        if s is not None and s not in seen:
            seen.append(s)
    if not seen:
        return "the dataset"
    more = f" (+{len(seen) - limit} more)" if len(seen) > limit else ""
    return ", ".join(seen[:limit]) + more
