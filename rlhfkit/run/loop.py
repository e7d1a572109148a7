"""The training loop's cadence, written once for every trainer (SFT, reward model, DPO, KTO and the RL driver).

A trainer says what one step is; `TrainingLoop` does the rest, in this order after every step:

    resume (--load_checkpoint) -> trainer.start
    until the step cap (or the data) is used up:
        pause point "between" -> trainer.next_work -> trainer.step -> global_step + 1
        -> log the metrics (every --logging_steps) -> log a few samples (trainers that have them, ~5 steps a run)
        -> progress bar -> evaluate (every --eval_steps, or at the end of each pass with -1; the best metric kept)
        -> checkpoint (every --save_steps) -> SIGTERM: checkpoint, raise Preempted

The data position (`LoopState`: the pass over the data and the batch in it) is the trainer's to advance: an
offline trainer draws one global batch per step, an RL step may draw more prompts (dynamic filtering) or adopt the
position of a batch generated ahead (async). Everything in `LoopState`, with the trainer's own `extra_state` (RL:
the KL controller's coefficient), is saved in each checkpoint's `state.json` and restored by resume.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Protocol

from rlhfkit.config.common import CheckpointArgs, LoggingArgs
from rlhfkit.data.sampler import global_batches
from rlhfkit.distributed.strategy import DeepSpeedStrategy
from rlhfkit.errors import Preempted, UserError
from rlhfkit.logging.metrics import MetricsLogger, Progress
from rlhfkit.run.checkpoint import resume, save_checkpoint
from rlhfkit.run.pause_points import pause_point
from rlhfkit.run.preemption import PreemptionWatch, preemption_message
from rlhfkit.run.runs import RunInfo

REPORT_SAMPLE_STEPS = 5  # the run report shows samples of the first and last step and of about this many more


@lru_cache(maxsize=2)
def _pass_batches(num_items: int, batch_size: int, seed: int, epoch: int) -> list[list[int]]:
    """One pass's shuffled global batches (cached: each step draws one of them)."""
    return global_batches(num_items, batch_size, seed, epoch)


@dataclass
class LoopState:
    """Where training is; saved in every checkpoint so a resumed run continues with the same data order."""

    global_step: int = 0  # steps finished
    epoch: int = 0  # the pass over the data (an RL run calls it the episode, --num_episodes)
    batch_in_epoch: int = 0  # global batches of that pass already drawn
    best_metric: float | None = None  # --best_metric_key: the best value so far (its model is in <save_path>/best)

    def next_batch(self, num_items: int, batch_size: int, seed: int, max_epochs: int) -> list[int] | None:
        """The next global batch (item indices) of the data shuffled per pass, advancing the position; None when
        `max_epochs` passes are used up. A pass is finished lazily, when the next batch is drawn, so a checkpoint
        saved after a pass's last batch resumes into the next pass."""
        if self.batch_in_epoch >= num_items // batch_size:
            self.epoch += 1
            self.batch_in_epoch = 0
        if self.epoch >= max_epochs:
            return None
        batch = list(_pass_batches(num_items, batch_size, seed, self.epoch)[self.batch_in_epoch])  # the caller's
        self.batch_in_epoch += 1
        return batch

    def saved(self, pass_name: str, extra: dict[str, Any]) -> dict[str, Any]:
        """What `state.json` holds (the checkpoint adds global_step); a pass is named as the trainer names it."""
        out = {pass_name: self.epoch, f"batch_in_{pass_name}": self.batch_in_epoch, **extra}
        if self.best_metric is not None:
            out["best_metric"] = self.best_metric
        return out

    def restore(self, saved: dict[str, Any], pass_name: str) -> None:
        """Take the position `saved` (a state.json) holds, in place: the loop keeps one LoopState a whole run."""
        self.global_step = saved["global_step"]
        self.epoch = saved[pass_name]
        self.batch_in_epoch = saved[f"batch_in_{pass_name}"]
        self.best_metric = saved.get("best_metric")


class Trainer(Protocol):
    """What a trainer supplies to `TrainingLoop`. The first six are required; the rest have defaults (a trainer that
    subclasses this protocol inherits them)."""

    def steps_per_epoch(self) -> int:
        """Steps of one pass over the data (global batches, or rollout batches of prompts)."""
        ...

    def next_work(self, state: LoopState) -> Any | None:
        """What the next step trains on (e.g. `state.next_batch(...)`), advancing the data position; None: no
        data left."""
        ...

    def step(self, work: Any, state: LoopState) -> dict[str, float]:
        """Train one step on `work` (`state.global_step` steps are finished); returns the step's metrics."""
        ...

    def progress_fields(self, metrics: dict[str, float]) -> dict[str, float]:
        """What the progress bar shows of a step's metrics."""
        ...

    def evaluate(self, step: int) -> dict[str, float] | None:
        """Evaluate and log (prefix `eval`); returns the metrics (for --best_metric_key), None: nothing to
        evaluate on."""
        ...

    def checkpoint_targets(self) -> dict[str, Any]:
        """What a checkpoint saves by name: DeepSpeed engines, or roles that save themselves (`save_checkpoint`)."""
        ...

    def start(self, state: LoopState) -> None:
        """Called once before the first step, after any resume (RL: the first weight sync)."""
        return None

    def report_rows(self) -> list[dict[str, Any]]:
        """A few samples of the latest step for the run report (RL: prompt, response, reward)."""
        return []

    def save_best(self, path: str) -> None:
        """Export the model as it is now to `path` (--best_metric_key)."""
        raise TypeError(f"{type(self).__name__} cannot export a best model (--best_metric_key)")

    def extra_state(self) -> dict[str, Any]:
        """The trainer's own resumable state, saved next to `LoopState` (RL: {"kl_coef": ...})."""
        return {}

    def load_extra_state(self, saved: dict[str, Any]) -> None:
        """Restore what `extra_state` saved (`saved` is the whole state.json)."""
        return None


@dataclass
class LoopSettings:
    """How often the loop logs, evaluates and saves, and how long it runs."""

    name: str  # the progress bar's label
    max_epochs: int  # passes over the data (RL: --num_episodes)
    max_steps: int  # step cap, -1: none (RL: --max_rl_steps)
    logging: LoggingArgs
    checkpoint: CheckpointArgs
    best_metric_key: str | None = None  # "eval/<metric>": export the model whenever it beats every earlier eval
    eval_at_end: bool = False  # with --eval_steps -1: also evaluate after a last step that ended no pass
    pass_name: str = "epoch"  # what state.json calls a pass over the data ("episode" in RL checkpoints)


def best_model_path(save_path: str) -> str:
    """Where --best_metric_key exports the best model: <save_path>/best."""
    return os.path.join(save_path, "best")


class TrainingLoop:
    """Runs a `Trainer` with the cadence of the module docstring. `state` is where training is; `history` the
    per-step metrics of the latest `fit`."""

    def __init__(self, trainer: Trainer, settings: LoopSettings, strategy: DeepSpeedStrategy,
                 logger: MetricsLogger, run: RunInfo):
        self.trainer = trainer
        self.settings = settings
        self.strategy = strategy
        self.logger = logger
        self.run = run  # the identity written into (and checked against) the checkpoints
        self.state = LoopState()
        self.history: list[dict[str, float]] = []
        self._last_eval_step = -1

    def total_steps(self) -> int:
        """Steps this run trains: every pass, or fewer with a step cap."""
        steps = self.trainer.steps_per_epoch() * self.settings.max_epochs
        return steps if self.settings.max_steps < 0 else min(steps, self.settings.max_steps)

    def fit(self) -> list[dict[str, float]]:
        """Train; returns the per-step metrics (rank 0 also logs them). On SIGTERM it saves a checkpoint at the next
        step boundary and raises Preempted (the CLI exits 0)."""
        with PreemptionWatch(self.strategy) as preemption:
            if self.settings.checkpoint.load_checkpoint:
                self.resume()
            self.trainer.start(self.state)
            self.history = []
            total = self.total_steps()
            bar = Progress(total, self.state.global_step, self.settings.name,
                           self.strategy.is_rank0 and not self.settings.logging.disable_progress_bar)
            while self.state.global_step < total:
                pause_point("between", self.state.global_step)
                work = self.trainer.next_work(self.state)
                if work is None:
                    break
                metrics = self.trainer.step(work, self.state)
                self.state.global_step += 1
                self.history.append(metrics)
                self._after_step(metrics, total, bar, preemption)
            if self.settings.eval_at_end and self._evaluates_per_pass() and \
                    self._last_eval_step != self.state.global_step:
                self.evaluate(self.state.global_step)  # a step cap ended the run inside a pass
            bar.close()
        return self.history

    def _evaluates_per_pass(self) -> bool:
        return self.settings.logging.eval_steps < 0

    def _after_step(self, metrics: dict[str, float], total: int, bar: Progress, preemption: PreemptionWatch) -> None:
        """Logging, evaluation, checkpoint and the preemption check after step `state.global_step`."""
        log, step = self.settings.logging, self.state.global_step
        if step % log.logging_steps == 0:
            self.logger.log(step, metrics)
        if step == 1 or step == total or step % max(total // REPORT_SAMPLE_STEPS, 1) == 0:
            self.logger.log_samples(step, self.trainer.report_rows())
        bar.update(self.trainer.progress_fields(metrics))
        pass_done = self.state.batch_in_epoch >= self.trainer.steps_per_epoch()
        if (log.eval_steps > 0 and step % log.eval_steps == 0) or (self._evaluates_per_pass() and pass_done):
            self.evaluate(step)
        c = self.settings.checkpoint
        saved = c.save_steps > 0 and step % c.save_steps == 0
        if saved:
            self.save_checkpoint()
        if preemption.requested():
            bar.close()
            if not saved:
                self.save_checkpoint()
            raise Preempted(preemption_message(step, c.ckpt_path))

    # -- evaluation and the best model ----------------------------------------------------------------------
    def evaluate(self, step: int) -> dict[str, float] | None:
        metrics = self.trainer.evaluate(step)
        if metrics is not None:
            self._last_eval_step = step
            self._keep_best(step, metrics)
        return metrics

    def _keep_best(self, step: int, metrics: dict[str, float]) -> None:
        """--best_metric_key: export the model to <save_path>/best when the metric beats every earlier eval."""
        key = self.settings.best_metric_key
        if key is None:
            return
        name = key.removeprefix("eval/")
        if name not in metrics:
            raise UserError(f"--best_metric_key {key}: evaluation logs no such metric; it logs "
                            f"{', '.join('eval/' + k for k in sorted(metrics))}")
        value = metrics[name]
        if self.state.best_metric is not None and value <= self.state.best_metric:
            return
        self.state.best_metric = value
        path = best_model_path(self.settings.checkpoint.save_path)
        self.trainer.save_best(path)
        if self.strategy.is_rank0:
            with open(os.path.join(path, "best_metric.json"), "w") as f:
                json.dump({"metric": key, "value": value, "step": step}, f)

    # -- checkpoints ----------------------------------------------------------------------------------------
    def save_checkpoint(self) -> None:
        """The trainer's checkpoint targets, `LoopState` and the trainer's extra state at `state.global_step`."""
        c = self.settings.checkpoint
        state = self.state.saved(self.settings.pass_name, self.trainer.extra_state())
        save_checkpoint(self.strategy, c.ckpt_path, self.state.global_step, self.trainer.checkpoint_targets(),
                        state, c.max_ckpt_num, max_gb=c.max_ckpt_mem, universal=c.use_ds_universal_ckpt,
                        run=self.run)

    def resume(self) -> None:
        """Load the newest complete checkpoint of --ckpt_path into the targets, the state and the trainer's extra
        state; nothing there: start from scratch."""
        ckpt_path = self.settings.checkpoint.ckpt_path
        found = resume(self.strategy, ckpt_path, self.trainer.checkpoint_targets(), self.run)
        if found is None:
            self.strategy.print(f"no checkpoint in {ckpt_path}; starting from scratch")
            return
        path, saved = found
        self.state.restore(saved, self.settings.pass_name)
        self.trainer.load_extra_state(saved)
        self.logger.resumed_at(self.state.global_step)  # the steps after the checkpoint are trained (logged) again
        self.strategy.print(f"resumed from {path} at step {self.state.global_step}")
