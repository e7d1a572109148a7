"""Cutting a batch over the ranks of a role group and joining their results (`rlhfkit.distributed.ray_groups`'s
"split" dispatch).

With sequence parallelism (--ring_attn_size P) the P ranks of a sequence-parallel group share their rows (each
runs a slice of every row's tokens): the batch is cut into world / P parts, every rank of group k gets part k
(`split_for_groups`), and each group's result counts once (`results_of_groups`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def split_for_ranks(value: Any, n: int) -> list[Any]:
    """Cut `value` into n contiguous, nearly equal slices (the first slices get one more on a remainder)."""
    if isinstance(value, torch.Tensor):
        return list(torch.tensor_split(value, n, dim=0))
    if isinstance(value, dict):
        parts = {k: split_for_ranks(v, n) for k, v in value.items()}
        return [{k: parts[k][i] for k in value} for i in range(n)]
    if isinstance(value, tuple):
        columns = [split_for_ranks(v, n) for v in value]
        return [tuple(c[i] for c in columns) for i in range(n)]
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        size, extra = divmod(len(value), n)
        out, start = [], 0
        for i in range(n):
            stop = start + size + (1 if i < extra else 0)
            out.append(list(value[start:stop]))
            start = stop
        return out
    raise TypeError(f"cannot split a {type(value).__name__} over ranks; pass a list, tensor, dict or tuple")


def join_from_ranks(results: list[Any]) -> Any:
    """Inverse of `split_for_ranks` for results: concatenate in rank order, average numbers."""
    first = results[0]
    if first is None:
        return None
    if isinstance(first, torch.Tensor):
        return torch.cat(results, dim=0) if first.dim() > 0 else torch.stack(results).float().mean()
    if isinstance(first, dict):
        return {k: join_from_ranks([r[k] for r in results]) for k in first}
    if isinstance(first, tuple):
        return tuple(join_from_ranks(list(parts)) for parts in zip(*results))
    if isinstance(first, list):
        return [item for r in results for item in r]
    if isinstance(first, bool):
        return all(results)
    if isinstance(first, (int, float)):
        return sum(results) / len(results)
    return first


def split_for_groups(value: Any, world_size: int, sp_size: int = 1) -> list[Any]:
    """One part per rank: `value` cut into world_size / sp_size parts, part k for each of the sp_size consecutive
    ranks of sequence-parallel group k (the ranks [k x sp_size, (k + 1) x sp_size), as the strategy forms them)."""
    parts = split_for_ranks(value, world_size // sp_size)
    return [parts[rank // sp_size] for rank in range(world_size)]


def results_of_groups(results: list[Any], sp_size: int = 1) -> list[Any]:
    """The results of one rank per sequence-parallel group (its ranks return the same rows)."""
    return results[::sp_size]
