"""The RL driver: one loop for PPO, REINFORCE++, REINFORCE++-baseline, GRPO, Dr. GRPO and RLOO, synchronous or
asynchronous, local or on Ray.

One step (DESIGN.md, "The roles of an RL step"): the batch supply gives a `Rollout` (generated, scored, filtered:
`rlhfkit.rl.rollout_source`), the trainer finishes it and trains on it (`rlhfkit.rl.trainer`), and the trainer's
weight sync puts the new policy into the engines. The loop around it is the step cadence: resume, the first
weight sync, progress, logging, sample rows for the run report, evaluation, checkpoints, the best policy,
preemption. What varies between runs is only what is handed in:
- the batch supply: the run's `RolloutSource` itself (synchronous), or `async_driver.GeneratorQueue` (batches from
  the generator actor, --async_train);
- the trainer's weight sync: `weight_sync.LocalWeightSync` (train_ppo), `RayWeightSync` (train_ppo_ray),
  `async_driver.LockedWeightSync` (--async_train).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Protocol

from rlhfkit.config.rl import PPOConfig
from rlhfkit.errors import Preempted, UserError
from rlhfkit.logging.metrics import MetricsLogger, Progress
from rlhfkit.rl.role_protocols import Actor, Critic, Reference, Reward
from rlhfkit.rl.rollout_source import Rollout, RolloutSource
from rlhfkit.rl.trainer import RLTrainer
from rlhfkit.rollout.engine import RolloutEngine
from rlhfkit.run.checkpoint import resume, save_checkpoint
from rlhfkit.run.pause_points import pause_point
from rlhfkit.run.preemption import PreemptionWatch, preemption_message
from rlhfkit.run.runs import RunInfo

REPORT_ROLLOUT_STEPS = 5  # the run report shows rollouts of the first and last step and of about this many more


@dataclass
class RoleHandles:
    """What a runner builds (interfaces in `role_protocols.py`). Each is a local role object or a Ray actor group
    with the same methods; the reward may also be a text reward source, or None when agent episodes bring their
    rewards."""

    actor: Actor
    engine: RolloutEngine
    reward: Reward | None
    ref: Reference | None = None
    critic: Critic | None = None


class BatchSupply(Protocol):
    """Where the loop's rollouts come from: a `RolloutSource` (synchronous) or the async generator's queue."""

    def next_rollout(self, step: int) -> Rollout | None:
        """The rollout of RL step `step` (0-based), None when the data is used up."""
        ...

    def close(self) -> None: ...


def best_model_path(cfg: PPOConfig) -> str:
    """Where --best_metric_key exports the best policy: <save_path>/best."""
    return os.path.join(cfg.checkpoint.save_path, "best")


class RLLoop:
    """The step cadence around `trainer` fed by `supply`; `source` is the run's rollout source, whose stream
    position (the consumed one, also in async runs) checkpoints save."""

    def __init__(self, cfg: PPOConfig, trainer: RLTrainer, source: RolloutSource, supply: BatchSupply,
                 logger: MetricsLogger, strategy: Any, run: RunInfo | None = None):
        self.cfg = cfg
        self.trainer = trainer
        self.source = source
        self.supply = supply
        self.logger = logger
        self.strategy = strategy  # rank / barrier / RNG capture for checkpoints (the driver's)
        self.run = run or RunInfo("ppo")  # identity written into (and checked against) the checkpoints
        self.global_step = 0
        self.best_metric: float | None = None  # --best_metric_key: the best value so far (model in <save_path>/best)
        self._last_eval_step = -1
        self._last_rollouts: list[dict[str, Any]] = []

    def total_steps(self) -> int:
        """RL steps this run trains (--max_rl_steps caps the --num_episodes passes)."""
        steps = self.source.stream.steps_per_episode() * self.cfg.rollout.num_episodes
        return steps if self.cfg.rollout.max_rl_steps < 0 else min(steps, self.cfg.rollout.max_rl_steps)

    # -- one step ---------------------------------------------------------------------------------------------
    def step(self) -> dict[str, float] | None:
        """One RL step: the next rollout, finished and trained on; its metrics, or None when the data is used up."""
        step = self.global_step
        rollout = self.supply.next_rollout(step)
        if rollout is None:
            return None
        exp, metrics = self.trainer.finish_experience(rollout, step)
        metrics.update(rollout.extra_metrics)
        self._last_rollouts = rollout.report_rows()
        pause_point("mid", step + 1)
        return self.trainer.train(exp, metrics, step, rollout.started)

    # -- the loop ---------------------------------------------------------------------------------------------
    def fit(self) -> list[dict[str, float]]:
        """Train; on SIGTERM save a checkpoint at the next step boundary and raise Preempted (the CLI exits 0). The
        batch supply is closed whatever happens."""
        try:
            with PreemptionWatch(self.strategy) as self._preemption:
                return self._fit()
        finally:
            self.supply.close()

    def _fit(self) -> list[dict[str, float]]:
        cfg = self.cfg
        if cfg.checkpoint.load_checkpoint:
            self.resume()
        self.trainer.weight_sync.sync()
        total = self.total_steps()
        history: list[dict[str, float]] = []
        bar = Progress(total, self.global_step, cfg.algo.advantage_estimator,
                       self.strategy.is_rank0 and not cfg.logging.disable_progress_bar)
        while self.global_step < total:
            pause_point("between", self.global_step)
            metrics = self.step()
            if metrics is None:
                break
            self.global_step += 1
            history.append(metrics)
            self._after_step(metrics, total, bar)
        if cfg.logging.eval_steps < 0 and self._last_eval_step != self.global_step:
            self.evaluate(self.global_step)  # --max_rl_steps ended the run inside an episode
        bar.close()
        return history

    def _after_step(self, metrics: dict[str, float], total: int, bar: Progress) -> None:
        """Logging, report rows, progress, evaluation, checkpoint and preemption after step `self.global_step`."""
        cfg, log, step = self.cfg, self.cfg.logging, self.global_step
        if step % log.logging_steps == 0:
            self.logger.log(step, metrics)
        if step == 1 or step == total or step % max(total // REPORT_ROLLOUT_STEPS, 1) == 0:
            self.logger.log_samples(step, self._last_rollouts)
        bar.update({"reward": metrics["reward"], "len": metrics["response_length"], "kl": metrics["kl"],
                    "pg": metrics.get("actor/policy_loss", 0.0)})
        episode_done = self.source.stream.episode_done()
        if (log.eval_steps > 0 and step % log.eval_steps == 0) or (log.eval_steps < 0 and episode_done):
            self.evaluate(step)
        saved = cfg.checkpoint.save_steps > 0 and step % cfg.checkpoint.save_steps == 0
        if saved:
            self.save_checkpoint()
        if self._preemption.requested():
            bar.close()
            if not saved:
                self.save_checkpoint()
            raise Preempted(preemption_message(step, cfg.checkpoint.ckpt_path))

    # -- evaluation -------------------------------------------------------------------------------------------
    def evaluate(self, step: int) -> dict[str, float] | None:
        """The trainer's evaluation, logged under eval/, printed, and kept as the best policy when it is."""
        metrics = self.trainer.evaluate()
        if metrics is None:
            return None
        self._last_eval_step = step
        self.logger.log(step, metrics, prefix="eval")
        self.strategy.print(f"eval @ step {step}: reward {metrics['reward']:.4f}, pass@1 {metrics['pass@1']:.4f}")
        self._keep_best(step, metrics)
        return metrics

    def _keep_best(self, step: int, metrics: dict[str, float]) -> None:
        """--best_metric_key: export the policy to <save_path>/best when the metric beats every earlier eval."""
        key = self.cfg.save.best_metric_key
        if key is None:
            return
        name = key.removeprefix("eval/")
        if name not in metrics:
            raise UserError(f"--best_metric_key {key}: evaluation logs no such metric; it logs "
                            f"{', '.join('eval/' + k for k in sorted(metrics))}")
        value = metrics[name]
        if self.best_metric is not None and value <= self.best_metric:
            return
        self.best_metric = value
        path = best_model_path(self.cfg)
        self.trainer.save_policy(path)
        if self.strategy.is_rank0:
            with open(os.path.join(path, "best_metric.json"), "w") as f:
                json.dump({"metric": key, "value": value, "step": step}, f)

    # -- checkpoints ------------------------------------------------------------------------------------------
    def save_checkpoint(self) -> None:
        """Roles' states and the loop's: the stream position, the KL coefficient, the best metric."""
        c = self.cfg.checkpoint
        state = {**self.source.stream.state_dict(), "kl_coef": self.trainer.kl_ctl.value,
                 "best_metric": self.best_metric}
        save_checkpoint(self.strategy, c.ckpt_path, self.global_step, self.trainer.checkpoint_targets(), state,
                        c.max_ckpt_num, max_gb=c.max_ckpt_mem, run=self.run)  # roles pick universal or not

    def resume(self) -> None:
        c = self.cfg.checkpoint
        found = resume(self.strategy, c.ckpt_path, self.trainer.checkpoint_targets(), self.run)
        if found is None:
            self.strategy.print(f"no checkpoint in {c.ckpt_path}; starting from scratch")
            return
        path, saved = found
        self.source.stream.load_state_dict(saved)
        self.global_step = saved["global_step"]
        self.trainer.kl_ctl.value = saved["kl_coef"]
        self.best_metric = saved.get("best_metric")
        self.strategy.print(f"resumed from {path} at step {self.global_step}")
