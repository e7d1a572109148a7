"""The replay buffer of one RL step: the rollout batch cut into optimizer steps and micro-batches.

The batching rule is the SFT trainer's (`rlhfkit/data/sampler.py`), applied to the samples of one rollout: every
epoch (`--max_epochs`) shuffles the samples with a generator seeded by (seed, epoch), cuts them into optimizer steps
of `--train_batch_size` samples, and each step into micro-batches of `--micro_train_batch_size`; micro-batch k of a
step belongs to rank k % world_size. So every rank builds the same buffer from the same experience and trains on
its own micro-batches, and one rank trains on exactly what N ranks train on together.

Token-level loss aggregation over the whole optimizer step needs the step's token (or sequence) count, all ranks
together: each `OptimizerStep` carries them, so a micro-batch loss normalised by them sums, over the micro-batches
and ranks of the step, to one mean over the step (DAPO's token-level loss, Yu et al. 2025).

With a token budget (`--use_dynamic_batch --max_tokens_per_gpu`) the step's samples are the same, but they are
split over ranks and micro-batches by token count (`rlhfkit.data.token_budget`): packed cost (sum of sequence
lengths) with `--packing_samples`, else rows x the longest sequence. Every rank gets the same number of
micro-batches; a rank with fewer runs fillers (`real` False) that the roles weight by 0.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from rlhfkit.data.sampler import check_batch_sizes
from rlhfkit.data.token_budget import plan_micro_batches
from rlhfkit.rl.experience import Experience


@dataclass
class OptimizerStep:
    """This rank's micro-batches of one optimizer step and the step's totals over all ranks."""

    micro_batches: list[Experience]
    num_tokens: int  # action tokens in the whole step (every rank's micro-batches)
    num_seqs: int  # samples in the whole step
    real: list[bool] | None = None  # per micro-batch; False marks a zero-weight filler (None: all real)

    def is_real(self, k: int) -> bool:
        return self.real is None or self.real[k]


def one_optimizer_step(samples: int, train_batch_size: int, max_epochs: int) -> bool:
    """True when training on `samples` samples makes exactly one optimizer step: the weights that produced the
    rollout's old log-probs are then unchanged until after the last micro-batch's backward."""
    return max_epochs == 1 and train_batch_size == samples


class ReplayBuffer:
    def __init__(self, experience: Experience, train_batch_size: int, micro_batch_size: int, *, rank: int = 0,
                 world_size: int = 1, seed: int = 0, shuffle: bool = True, max_tokens: int | None = None,
                 packed: bool = False):
        check_batch_sizes(train_batch_size, micro_batch_size, world_size)
        if len(experience) % train_batch_size:
            raise ValueError(f"the rollout holds {len(experience)} samples, not a multiple of the train batch size "
                             f"{train_batch_size}")
        self.experience = experience
        self.train_batch_size = train_batch_size
        self.micro_batch_size = micro_batch_size
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.shuffle = shuffle
        self.max_tokens = max_tokens  # token budget per micro-batch (None: micro_batch_size samples)
        self.packed = packed

    def __len__(self) -> int:
        return len(self.experience)

    def steps_per_epoch(self) -> int:
        return len(self.experience) // self.train_batch_size

    def order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(len(self.experience)))
        generator = torch.Generator().manual_seed(self.seed * 1000 + epoch)
        return torch.randperm(len(self.experience), generator=generator).tolist()

    def epoch(self, epoch: int) -> Iterator[OptimizerStep]:
        """The optimizer steps of one pass over the buffer, for this rank."""
        order = self.order(epoch)
        mask_rows = self.experience.action_mask.sum(dim=1)
        for start in range(0, len(order), self.train_batch_size):
            step_rows = order[start:start + self.train_batch_size]
            mine = self.split_step(step_rows)
            yield OptimizerStep(
                micro_batches=[self.experience.select(rows or step_rows[:1]).trimmed() for rows in mine],
                num_tokens=int(mask_rows[torch.tensor(step_rows)].sum()),
                num_seqs=len(step_rows),
                real=[bool(rows) for rows in mine],
            )

    def split_step(self, step_rows: list[int]) -> list[list[int]]:
        """This rank's micro-batches (rows of the experience) of one step; [] is a filler."""
        if self.max_tokens is None:
            chunks = [step_rows[i:i + self.micro_batch_size]
                      for i in range(0, len(step_rows), self.micro_batch_size)]
            return chunks[self.rank::self.world_size]
        lengths = self.experience.attention_mask[torch.tensor(step_rows)].sum(dim=1).tolist()
        plan = plan_micro_batches(lengths, self.max_tokens, self.world_size,
                                  widths=None if self.packed else lengths)
        return [[step_rows[j] for j in micro] for micro in plan[self.rank]]
