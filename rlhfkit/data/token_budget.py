"""Token-budget micro-batches (`--use_dynamic_batch --max_tokens_per_gpu N`): pure bin packing, no tensors.

With fixed micro-batches every forward holds `--micro_train_batch_size` samples, so a batch of short samples
under-uses the device and one long sample decides the memory peak. Here the samples of ONE optimizer step are cut
into micro-batches by token count instead: the step's sample set never changes, only its split, so with the loss
weighted by the step's true totals (not per micro-batch) the gradient of the step is the same.

The plan, for one optimizer step:
1. Ranks: the samples, longest first, each go to the rank with the fewest tokens so far (longest-processing-time
   greedy), which balances the ranks' work.
2. Micro-batches: on each rank, first-fit decreasing: a sample joins the first micro-batch it fits in, else opens
   a new one. The cost of a micro-batch is its packed token count (sum of lengths), or with `widths` (padded
   batches) rows x the longest row, which is what a padded forward computes.
3. Every rank gets the same number of micro-batches: ranks with fewer get empty ones at the end. The caller runs
   an empty micro-batch as a forward and backward with zero weight, because under ZeRO-3 every forward and backward
   is a collective that all ranks must join.
The plan is a function of the lengths only, so every rank computes the same plan without communicating.
"""

from __future__ import annotations

from collections.abc import Sequence

Plan = list[list[list[int]]]  # plan[rank][micro_batch] = indices into the step's samples


def micro_batch_cost(indices: Sequence[int], lengths: Sequence[int], widths: Sequence[int] | None = None,
                     rows_per_sample: int = 1) -> int:
    """Tokens a forward of these samples computes: the sum of their lengths (packed), or with `widths` (the longest
    row of each sample), rows x the longest row (padded)."""
    if not indices:
        return 0
    if widths is None:
        return sum(lengths[i] for i in indices)
    return rows_per_sample * len(indices) * max(widths[i] for i in indices)


def _check(lengths: Sequence[int], max_tokens: int, world_size: int, widths: Sequence[int] | None,
           rows_per_sample: int) -> None:
    if max_tokens < 1 or world_size < 1 or rows_per_sample < 1:
        raise ValueError(f"max_tokens ({max_tokens}), world_size ({world_size}) and rows_per_sample "
                         f"({rows_per_sample}) must be positive")
    if widths is not None and len(widths) != len(lengths):
        raise ValueError(f"{len(widths)} widths for {len(lengths)} lengths")
    for i in range(len(lengths)):
        if lengths[i] < 0:
            raise ValueError(f"sample {i} has a negative length {lengths[i]}")
        cost = micro_batch_cost([i], lengths, widths, rows_per_sample)
        if cost > max_tokens:
            raise ValueError(f"sample {i} alone costs {cost} tokens, more than the budget of {max_tokens}")


def split_over_ranks(lengths: Sequence[int], world_size: int) -> list[list[int]]:
    """Sample indices per rank, balancing the token count (longest first to the least-loaded rank; ties go to
    the lower index and the lower rank, so the result is deterministic)."""
    loads = [0] * world_size
    ranks: list[list[int]] = [[] for _ in range(world_size)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = min(range(world_size), key=lambda r: (loads[r], r))
        ranks[r].append(i)
        loads[r] += lengths[i]
    return [sorted(r) for r in ranks]


def first_fit_decreasing(indices: Sequence[int], lengths: Sequence[int], max_tokens: int,
                         widths: Sequence[int] | None = None, rows_per_sample: int = 1) -> list[list[int]]:
    """Micro-batches (lists of indices, ascending) of `indices` whose cost stays within `max_tokens`."""
    size = widths if widths is not None else lengths
    bins: list[list[int]] = []
    totals: list[list[int]] = []  # per bin: [tokens, longest row] so a fit test costs O(1)
    for i in sorted(indices, key=lambda i: (-size[i], i)):
        for k, (tokens, width) in enumerate(totals):
            new_cost = (tokens + lengths[i] if widths is None
                        else rows_per_sample * (len(bins[k]) + 1) * max(width, widths[i]))
            if new_cost <= max_tokens:
                bins[k].append(i)
                totals[k] = [tokens + lengths[i], max(width, size[i])]
                break
        else:
            bins.append([i])
            totals.append([lengths[i], size[i]])
    return [sorted(b) for b in bins]


def plan_micro_batches(lengths: Sequence[int], max_tokens: int, world_size: int = 1, *,
                       widths: Sequence[int] | None = None, rows_per_sample: int = 1) -> Plan:
    """The token-budget plan of one optimizer step (see the module docstring): plan[rank] is that rank's list of
    micro-batches, each a list of indices into `lengths`; every rank has the same number of micro-batches (some
    possibly empty), and every index appears exactly once.

    lengths: tokens of each sample (all its rows); widths: its longest row, for padded batches (None: packed);
    rows_per_sample: rows a sample becomes in a padded batch (2 for a preference pair)."""
    _check(lengths, max_tokens, world_size, widths, rows_per_sample)
    cost = [micro_batch_cost([i], lengths, widths, rows_per_sample) for i in range(len(lengths))]
    plan = [first_fit_decreasing(mine, lengths, max_tokens, widths, rows_per_sample)
            for mine in split_over_ranks(cost, world_size)]
    count = max(1, max(len(p) for p in plan))
    return [p + [[] for _ in range(count - len(p))] for p in plan]
