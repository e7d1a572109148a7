"""What every offline trainer (SFT, reward model, DPO, KTO) shares: one optimizer step over a global batch of samples,
run by the loop of `rlhfkit.run.loop`, plus the micro-batch and evaluation-shard helpers.

For each global batch, every rank runs its micro-batches, DeepSpeed accumulates and steps; metrics are reduced over
ranks and logged by rank 0. A trainer subclasses `OfflineTrainer` and says what one optimizer step (`train_batch`)
and an evaluation (`evaluate`) are.

Micro-batches hold --micro_train_batch_size samples, or with --use_dynamic_batch as many as fit in
--max_tokens_per_gpu tokens (`rlhfkit.data.token_budget`; every rank runs the same number, a rank with fewer runs
zero-weight fillers). Either way a trainer weights a micro-batch's loss by the optimizer step's true totals (all
ranks), so the step's gradient does not depend on how the step is split into micro-batches or ranks. The trainer owns
the accumulation boundary (the last micro-batch of a step), as a token budget varies the micro-batches per step.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from rlhfkit.config.base import required
from rlhfkit.config.common import CheckpointArgs, LoggingArgs
from rlhfkit.data.sampler import micro_batches_for_rank
from rlhfkit.data.token_budget import plan_micro_batches
from rlhfkit.distributed.accumulation import mark_accumulation_boundary
from rlhfkit.distributed.nonfinite import NonFiniteGuard
from rlhfkit.distributed.strategy import DeepSpeedStrategy
from rlhfkit.logging.metrics import MetricsLogger
from rlhfkit.run.loop import LoopSettings, LoopState, Trainer, TrainingLoop
from rlhfkit.run.pause_points import pausing_after_first
from rlhfkit.run.runs import RunInfo

Collate = Callable[[Sequence[Any]], dict[str, torch.Tensor]]


def to_device(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}


class OfflineTrainer(Trainer):
    """A `Trainer` of the shared loop whose step is one optimizer step over a global batch of samples. Subclasses
    define `train_batch`, `evaluate` and `progress_fields`; `fit` runs the loop (`self.loop`)."""

    kind = "loop"
    nonfinite: NonFiniteGuard  # skipped non-finite updates of the current fit (made by `start`)

    def __init__(self, strategy: DeepSpeedStrategy, engine: Any, tokenizer: Any, train_samples: Sequence[Any],
                 eval_samples: Sequence[Any] | None, collate: Collate, *, max_epochs: int, max_steps: int,
                 logging_args: LoggingArgs, ckpt_args: CheckpointArgs, logger: MetricsLogger,
                 aux_loss_coef: float = 0.0, packing: bool = False, run: RunInfo | None = None):
        self.strategy = strategy
        self.engine = engine
        self.tokenizer = tokenizer
        self.train_samples = train_samples
        self.eval_samples = eval_samples
        self.collate = collate
        self.max_epochs = max_epochs
        self.logger = logger
        self.aux_loss_coef = aux_loss_coef
        self.packing = packing  # the collate packs: a token budget counts tokens, not rows x longest row
        self.args = strategy.args
        self.micro_scale = 1.0  # weight of the current micro-batch's loss in its optimizer step (set per micro)
        settings = LoopSettings(name=self.kind, max_epochs=max_epochs, max_steps=max_steps, logging=logging_args,
                                checkpoint=ckpt_args)
        # `run`: the identity written into (and checked against) the checkpoints
        self.loop = TrainingLoop(self, settings, strategy, logger, run or RunInfo(self.kind))

    @property
    def state(self) -> LoopState:
        """Where training is (the loop's state)."""
        return self.loop.state

    @property
    def history(self) -> list[dict[str, float]]:
        """Per-step training metrics of the latest fit (also of one that stopped early)."""
        return self.loop.history

    def fit(self) -> list[dict[str, float]]:
        """Train (`TrainingLoop.fit`); returns the per-step metrics."""
        return self.loop.fit()

    # -- the loop's Trainer protocol ------------------------------------------------------------------------
    def steps_per_epoch(self) -> int:
        return len(self.train_samples) // self.args.train_batch_size

    def start(self, state: LoopState) -> None:
        self.nonfinite = NonFiniteGuard(self.args.max_nonfinite_steps, self.kind)
        self.nonfinite.watch(self.engine)  # counting from the engine's state after any resume

    def next_work(self, state: LoopState) -> list[int] | None:
        """The next global batch of sample indices."""
        return state.next_batch(len(self.train_samples), self.args.train_batch_size, self.args.seed,
                                self.max_epochs)

    def step(self, work: list[int], state: LoopState) -> dict[str, float]:
        """One optimizer step over `work`, this rank's micro-batches of it; a non-finite update is skipped and
        counted (`nonfinite_skipped`), too many in a row stop the run."""
        started = time.perf_counter()
        micro = pausing_after_first(self.step_micro_batches(work), state.global_step + 1)
        metrics = self.train_batch(micro, started, work)
        metrics["nonfinite_skipped"] = self.nonfinite.after_step(state.global_step + 1, self.engine)
        return metrics

    def checkpoint_targets(self) -> dict[str, Any]:
        return {"model": self.engine}

    def train_batch(self, micro: Sequence[Sequence[int]], started: float,
                    global_batch: Sequence[int]) -> dict[str, float]:
        """One optimizer step over this rank's micro batches (sample indices, `step_micro_batches`) of
        `global_batch`; returns the step's metrics."""
        raise NotImplementedError

    # -- micro-batches --------------------------------------------------------------------------------------
    rows_per_sample = 1  # rows a sample becomes in a padded batch

    def sample_size(self, sample: Any) -> tuple[int, int]:
        """(tokens, longest row) of one training sample, for the token budget."""
        n = len(sample["input_ids"])
        return n, n

    def step_micro_batches(self, global_batch: Sequence[int]) -> list[list[int]]:
        """This rank's micro-batches (sample indices) of one optimizer step; [] is a zero-weight filler."""
        rank, world = self.strategy.dp_rank, self.strategy.dp_world_size  # a sequence-parallel group shares samples
        if not self.args.use_dynamic_batch:
            return micro_batches_for_rank(list(global_batch), self.args.micro_train_batch_size, rank, world)
        lengths, widths = zip(*(self.sample_size(self.train_samples[i]) for i in global_batch))
        plan = plan_micro_batches(lengths, required(self.args.max_tokens_per_gpu, "max_tokens_per_gpu"), world,
                                  widths=None if self.packing else widths, rows_per_sample=self.rows_per_sample)
        return [[global_batch[j] for j in micro] for micro in plan[rank]]

    def micro_batches(self, micro: Sequence[Sequence[int]], global_batch: Sequence[int]
                      ) -> Iterable[tuple[dict[str, torch.Tensor], bool]]:
        """Collated micro-batches with whether each is real, marking the step's last one as the accumulation
        boundary before its forward. A filler reruns the step's first sample (its loss is weighted by 0)."""
        for k, indices in enumerate(micro):
            mark_accumulation_boundary(self.engine, k == len(micro) - 1, self.args.use_dynamic_batch)
            yield self.collate([self.train_samples[i] for i in (indices or global_batch[:1])]), bool(indices)

    def sharded_batches(self, samples: Sequence[Any], limit: int | None = None
                        ) -> Iterable[tuple[dict[str, torch.Tensor], bool]]:
        """This rank's share of the first `limit` `samples` (all by default) in micro batches, yielded as
        (batch, is_real). Every rank yields the same number of batches, because ZeRO-3 forward passes are
        collective: a rank whose shard runs out (an eval set whose size is not a multiple of world size x micro
        batch) pads with sample 0, marked is_real False, and the caller leaves that batch out of its metrics."""
        n = len(samples) if limit is None or limit < 0 else min(limit, len(samples))
        # by data-parallel rank: the ranks of a sequence-parallel group run the same batches together
        rank, world, m = self.strategy.dp_rank, self.strategy.dp_world_size, self.args.micro_train_batch_size
        mine = list(range(rank, n, world))
        num_batches = math.ceil(math.ceil(n / world) / m)
        for b in range(num_batches):
            chunk = mine[b * m:(b + 1) * m]
            yield self.collate([samples[i] for i in (chunk or [0])]), bool(chunk)

    def backward_and_step(self, loss: torch.Tensor) -> None:
        """Backward a micro-batch loss already weighted for the whole step (no DeepSpeed 1/accumulation scaling),
        times `micro_scale`; the engine steps the optimizer at the boundary."""
        self.engine.backward(loss * self.micro_scale, scale_wrt_gas=False)
        self.engine.step()
