"""The batching rule every trainer uses, so a 1-rank run and an N-rank run see the same global batches.

An epoch is a permutation of the sample indices (torch.Generator seeded with seed + epoch) cut into global
batches. A global batch is cut into consecutive micro-batches; micro-batch k goes to rank k % world_size. So the
union of every rank's micro-batches is exactly the 1-rank micro-batch list, and each rank accumulates
train_batch_size / (micro_train_batch_size x world_size) micro-batches per optimizer step.
"""

from __future__ import annotations

import torch

from rlhfkit.errors import UserError


def check_batch_sizes(global_batch_size: int, micro_batch_size: int, world_size: int = 1) -> int:
    """Micro-batches per rank of one global batch; a ValueError when the sizes do not divide (the flags were
    checked when parsed, `rlhfkit.config.common.check_batch_split`, so this is a caller's mistake)."""
    if global_batch_size < 1 or micro_batch_size < 1 or world_size < 1:
        raise ValueError(f"batch sizes must be positive (got global {global_batch_size}, micro {micro_batch_size}, "
                         f"world size {world_size})")
    if global_batch_size % (micro_batch_size * world_size):
        raise ValueError(f"a global batch of {global_batch_size} samples does not split into micro-batches of "
                         f"{micro_batch_size} over {world_size} rank(s)")
    return global_batch_size // (micro_batch_size * world_size)


def global_batches(num_samples: int, global_batch_size: int, seed: int, epoch: int,
                   drop_last: bool = True) -> list[list[int]]:
    """The epoch's global batches of sample indices, shuffled with torch.Generator(seed + epoch).

    With drop_last, the incomplete last batch is dropped, and a dataset smaller than one batch is a UserError
    (the run would train zero steps)."""
    if global_batch_size < 1:
        raise ValueError(f"the global batch size must be positive (got {global_batch_size})")
    if drop_last and num_samples < global_batch_size:
        raise UserError(f"--train_batch_size {global_batch_size} is larger than the dataset ({num_samples} "
                        "samples); lower it or add data")
    gen = torch.Generator().manual_seed(seed + epoch)
    order = torch.randperm(num_samples, generator=gen).tolist()
    end = num_samples - num_samples % global_batch_size if drop_last else num_samples
    return [order[i: i + global_batch_size] for i in range(0, end, global_batch_size)]


def micro_batches_for_rank(global_batch: list[int], micro_batch_size: int, rank: int,
                           world_size: int) -> list[list[int]]:
    """This rank's micro-batches of a global batch: consecutive chunks of micro_batch_size, chunk k to rank
    k % world_size."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world size {world_size}")
    check_batch_sizes(len(global_batch), micro_batch_size, world_size)
    chunks = [global_batch[i: i + micro_batch_size] for i in range(0, len(global_batch), micro_batch_size)]
    return chunks[rank::world_size]
