"""The training loop every offline trainer (SFT, reward model, DPO, KTO) runs, and the helpers they share.

The loop is written out in full (nanoGPT style): for each global batch, every rank runs its micro-batches,
DeepSpeed accumulates and steps; metrics are reduced over ranks and logged by rank 0. A trainer subclasses
`TrainerLoop` and says what one optimizer step (`train_batch`) and an evaluation (`evaluate`) are.

Micro-batches hold --micro_train_batch_size samples, or with --use_dynamic_batch as many as fit in
--max_tokens_per_gpu tokens (`rlhfkit.data.token_budget`; every rank runs the same number, a rank with fewer runs
zero-weight fillers). Either way a trainer weights a micro-batch's loss by the optimizer step's true totals (all
ranks), so the step's gradient does not depend on how the step is split into micro-batches or ranks. The loop owns
the accumulation boundary (the last micro-batch of a step), as a token budget varies the micro-batches per step.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rlhfkit.config.base import required
from rlhfkit.config.common import CheckpointArgs, LoggingArgs
from rlhfkit.data.sampler import global_batches, micro_batches_for_rank
from rlhfkit.data.token_budget import plan_micro_batches
from rlhfkit.distributed.accumulation import mark_accumulation_boundary
from rlhfkit.distributed.nonfinite import NonFiniteGuard
from rlhfkit.distributed.strategy import DeepSpeedStrategy
from rlhfkit.errors import Preempted
from rlhfkit.logging.metrics import MetricsLogger, Progress
from rlhfkit.run.checkpoint import resume, save_checkpoint
from rlhfkit.run.pause_points import pause_point, pausing_after_first
from rlhfkit.run.preemption import PreemptionWatch, preemption_message
from rlhfkit.run.runs import RunInfo

Collate = Callable[[Sequence[Any]], dict[str, torch.Tensor]]


@dataclass
class LoopState:
    """Where training is: restored on resume so the data order continues exactly."""

    epoch: int = 0
    batch_in_epoch: int = 0
    global_step: int = 0


def to_device(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}


class TrainerLoop:
    """Epochs of global batches, logging, periodic evaluation and checkpoints, resume. Subclasses define
    `train_batch` (one optimizer step over this rank's micro batches), `evaluate` and `progress_fields`."""

    kind = "loop"

    def __init__(self, strategy: DeepSpeedStrategy, engine: Any, tokenizer: Any, train_samples: Sequence[Any],
                 eval_samples: Sequence[Any] | None, collate: Collate, *, max_epochs: int, max_steps: int,
                 logging_args: LoggingArgs, ckpt_args: CheckpointArgs, logger: MetricsLogger,
                 aux_loss_coef: float = 0.0, packing: bool = False,
                 run: RunInfo | None = None):
        self.strategy = strategy
        self.engine = engine
        self.tokenizer = tokenizer
        self.train_samples = train_samples
        self.eval_samples = eval_samples
        self.collate = collate
        self.max_epochs = max_epochs
        self.max_steps = max_steps
        self.log_args = logging_args
        self.ckpt_args = ckpt_args
        self.logger = logger
        self.aux_loss_coef = aux_loss_coef
        self.packing = packing  # the collate packs: a token budget counts tokens, not rows x longest row
        self.args = strategy.args
        self.micro_scale = 1.0  # weight of the current micro-batch's loss in its optimizer step (set per micro)
        self.state = LoopState()
        self.run = run or RunInfo(self.kind)  # identity written into (and checked against) the checkpoints
        self.history: list[dict[str, float]] = []  # per-step training metrics of the latest fit()

    def steps_per_epoch(self) -> int:
        return len(self.train_samples) // self.args.train_batch_size

    def total_steps(self) -> int:
        return self.steps_per_epoch() * self.max_epochs

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
        rank, world = self.strategy.rank, self.strategy.world_size
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
        rank, world, m = self.strategy.rank, self.strategy.world_size, self.args.micro_train_batch_size
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

    def progress_fields(self, metrics: dict[str, float]) -> dict[str, float]:
        """What the progress bar shows of a step's metrics."""
        raise NotImplementedError

    def evaluate(self, step: int) -> Any:
        raise NotImplementedError

    # -- the loop -------------------------------------------------------------------------------------------
    def fit(self) -> list[dict[str, float]]:
        """Train; returns the per-step metrics (rank 0 also logs them), also kept as `self.history`. On SIGTERM it
        saves a checkpoint at the next step boundary and raises Preempted (the CLI exits 0)."""
        with PreemptionWatch(self.strategy) as self._preemption:
            return self._fit()

    def _fit(self) -> list[dict[str, float]]:
        if self.ckpt_args.load_checkpoint:
            self.resume()
        history: list[dict[str, float]] = []
        self.history = history
        total = self.total_steps() if self.max_steps < 0 else min(self.max_steps, self.total_steps())
        nonfinite = NonFiniteGuard(self.args.max_nonfinite_steps, self.kind)
        nonfinite.watch(self.engine)
        bar = Progress(total, self.state.global_step, self.kind, self.strategy.is_rank0 and
                       not self.log_args.disable_progress_bar)
        while self.state.epoch < self.max_epochs and self.state.global_step < total:
            batches = global_batches(len(self.train_samples), self.args.train_batch_size, self.args.seed,
                                     self.state.epoch)
            while self.state.batch_in_epoch < len(batches) and self.state.global_step < total:
                pause_point("between", self.state.global_step)
                started = time.perf_counter()
                global_batch = batches[self.state.batch_in_epoch]
                micro = pausing_after_first(self.step_micro_batches(global_batch), self.state.global_step + 1)
                metrics = self.train_batch(micro, started, global_batch)
                self.state.batch_in_epoch += 1
                self.state.global_step += 1
                metrics["nonfinite_skipped"] = nonfinite.after_step(self.state.global_step, self.engine)
                history.append(metrics)
                step = self.state.global_step
                if step % self.log_args.logging_steps == 0:
                    self.logger.log(step, metrics)
                bar.update(self.progress_fields(metrics))
                if self.log_args.eval_steps > 0 and step % self.log_args.eval_steps == 0:
                    self.evaluate(step)
                saved = self.ckpt_args.save_steps > 0 and step % self.ckpt_args.save_steps == 0
                if saved:
                    self.save_checkpoint()
                if self._preemption.requested():
                    bar.close()
                    self.stop_for_preemption(already_saved=saved)
            if self.state.batch_in_epoch >= len(batches):
                if self.log_args.eval_steps < 0:
                    self.evaluate(self.state.global_step)
                self.state.epoch += 1
                self.state.batch_in_epoch = 0
        bar.close()
        return history

    # -- checkpoints ----------------------------------------------------------------------------------------
    def stop_for_preemption(self, already_saved: bool) -> None:
        if not already_saved:
            self.save_checkpoint()
        raise Preempted(preemption_message(self.state.global_step, self.ckpt_args.ckpt_path))

    def save_checkpoint(self) -> None:
        c = self.ckpt_args
        save_checkpoint(self.strategy, c.ckpt_path, self.state.global_step, {"model": self.engine}, vars(self.state),
                        c.max_ckpt_num, max_gb=c.max_ckpt_mem, universal=c.use_ds_universal_ckpt, run=self.run)

    def resume(self) -> None:
        found = resume(self.strategy, self.ckpt_args.ckpt_path, {"model": self.engine}, self.run)
        if found is None:
            self.strategy.print(f"no checkpoint in {self.ckpt_args.ckpt_path}; starting from scratch")
            return
        path, saved = found
        self.state = LoopState(epoch=saved["epoch"], batch_in_epoch=saved["batch_in_epoch"],
                               global_step=saved["global_step"])
        self.strategy.print(f"resumed from {path} at step {self.state.global_step}")
