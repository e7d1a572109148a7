"""The RL trainer: an RL step after the rollout (docs/architecture.md, "One RL step through the folders").

    Rollout (from the batch supply: the run's `rlhfkit.rl.rollout_source.RolloutSource`, or the async generator's
    queue, `rlhfkit.rl.async_driver.GeneratorQueue`)
    -> reference / critic / old-policy forwards                       (`finish_experience`)
    -> reward shaping and clipping, per-token KL, advantages and returns (`rlhfkit.algorithms`)
    -> critic update, actor update (replay buffer of micro-batches inside each role)   (`train`)
    -> weight sync actor -> rollout engines (the `WeightSync` handed in: `rlhfkit.rl.weight_sync`)
plus evaluation on held-out prompts and what checkpoints save. `RLTrainer` is a `rlhfkit.run.loop.Trainer`: the
shared loop skeleton (`TrainingLoop`, settings from `rlhfkit.rl.loop.rl_settings`) runs the step cadence around it.
The estimators differ only inside `compute_advantages` (and Dr. GRPO's loss aggregation, in the actor). The trainer
holds role *handles* and calls only their methods with CPU tensors, lists and dicts: local objects, or Ray actor
groups with the same methods.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

import torch

from rlhfkit.algorithms.advantages import compute_advantages
from rlhfkit.algorithms.kl import compute_approx_kl, make_kl_controller
from rlhfkit.algorithms.masking import masked_mean
from rlhfkit.config.rl import PPOConfig, reward_clip_bounds
from rlhfkit.logging.doctor import make_doctor, report_alarms
from rlhfkit.logging.metrics import MetricsLogger
from rlhfkit.rl.experience import Experience
from rlhfkit.rl.replay_buffer import one_optimizer_step
from rlhfkit.rl.role_protocols import Actor, Critic, Reference, Teacher
from rlhfkit.rl.rollout_source import SEED_STRIDE, Rollout, RolloutSource
from rlhfkit.rl.shaping import shape_rewards
from rlhfkit.rl.weight_sync import WeightSync
from rlhfkit.run.loop import LoopState, Trainer
from rlhfkit.run.pause_points import pause_point


class BatchSupply(Protocol):
    """Where the trainer's rollouts come from: the run's `RolloutSource` (synchronous) or the async generator's
    queue (`rlhfkit.rl.async_driver.GeneratorQueue`)."""

    def next_rollout(self, position: LoopState) -> Rollout | None:
        """The rollout of the step after `position.global_step` finished ones, advancing (or adopting) the data
        position; None when the data is used up."""
        ...

    def close(self) -> None:
        """Stop whatever the supply runs (the generator actor); the run is over."""
        ...


def _mean(t: torch.Tensor) -> float:
    return float(t.float().mean()) if t.numel() else 0.0


def _std(t: torch.Tensor) -> float:
    return float(t.float().std(unbiased=False)) if t.numel() > 1 else 0.0


def equal_reward_share(rewards: torch.Tensor, n_samples_per_prompt: int) -> float:
    """The share of prompts whose `n_samples_per_prompt` samples (consecutive in `rewards`) all got the same
    reward: their group advantages are zero, so a group estimator learns nothing from them."""
    groups = rewards.float().reshape(-1, n_samples_per_prompt)
    return float(((groups.amax(dim=1) - groups.amin(dim=1)) <= 1e-6).float().mean())


def reuses_old_log_probs(cfg: PPOConfig, has_reference: bool, samples: int, step: int) -> bool:
    """Whether RL step `step` (0-based) leaves the old-policy log-probs to the actor's training forward instead of
    an extra actor forward: the actor makes one optimizer step on the rollout (so its weights are still the
    rollout's old policy during that step; `roles.reused_old_log_probs`), and no KL penalty needs them in the
    rewards before training (no reference, --init_kl_coef 0, or the KL as a loss: --use_kl_loss)."""
    a = cfg.algo
    kl_in_reward = has_reference and a.init_kl_coef > 0 and not a.use_kl_loss
    actor_trains = step + 1 > a.freezing_actor_steps
    one_step = one_optimizer_step(samples, cfg.strategy.train_batch_size, cfg.rollout.max_epochs)
    return actor_trains and not kl_in_reward and one_step


def add_advantages(cfg: PPOConfig, exp: Experience, rewards: torch.Tensor, old_log_probs: torch.Tensor | None,
                   kl_coef: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token KL (when the old and the reference log-probs are here) and the estimator's advantages and returns,
    set into `exp` and returned."""
    a, mask, ref_log_probs = cfg.algo, exp.action_mask, exp.base_action_log_probs
    if ref_log_probs is not None and old_log_probs is not None:
        exp.kl = compute_approx_kl(old_log_probs, ref_log_probs, a.kl_estimator, mask)
    exp.advantages, exp.returns = compute_advantages(
        a.advantage_estimator, rewards=rewards, action_mask=mask,
        token_kl=exp.kl if a.init_kl_coef > 0 else None, values=exp.values,
        n_samples_per_prompt=cfg.rollout.n_samples_per_prompt, gamma=a.gamma, lambd=a.lambd, kl_coef=kl_coef,
        use_kl_loss=a.use_kl_loss, std_norm=not a.no_advantage_std_norm)
    return exp.advantages, exp.returns


def experience_metrics(exp: Experience, rollout: Rollout, advantages: torch.Tensor, returns: torch.Tensor,
                       old_log_probs: torch.Tensor | None, kl_coef: float) -> dict[str, float]:
    """A finished step's metrics before training: rewards, lengths, KL, advantages, the reward source's and the
    recipes' numbers, the rollout's timings. Without `old_log_probs` (left to the actor's training forward) the
    rollout-vs-actor log-prob gap comes from the actor's training instead."""
    mask, raw, reward = exp.action_mask, rollout.reward["rewards"], rollout.reward
    kl_per_sample = masked_mean(exp.kl, mask, dim=-1) if exp.kl is not None else torch.zeros(len(exp))
    lengths, rollout_log_probs = exp.info["response_length"], exp.rollout_log_probs
    return {
        "reward": _mean(raw), "reward_std": _std(raw), "score": _mean(reward["scores"]),
        "response_length": _mean(lengths), "response_length_max": float(lengths.max()),
        "truncated": _mean(exp.info["truncated"]), "kl": _mean(kl_per_sample), "kl_coef": kl_coef,
        "advantage_abs": float(masked_mean(advantages.abs(), mask)),
        "return": float(masked_mean(returns, mask)),
        **({} if old_log_probs is None or rollout_log_probs is None else {"rollout_logprob_diff": float(
            masked_mean((old_log_probs - rollout_log_probs).abs(), mask))}),
        **{f"reward_extra/{k}": float(v) for k, v in reward["extra_logs"].items()}, **reward["metrics"],
        **rollout.recipe_metrics, **rollout.timings,
    }


class RLTrainer(Trainer):
    """Finishes the rollouts of `supply` into training batches and trains the actor (and critic) on them;
    `weight_sync` moves the actor's weights into the rollout engines; `source` (the run's rollout source) generates
    and scores the held-out `eval_prompts` and sets the length of an episode; `logger` takes the evaluations."""

    def __init__(self, cfg: PPOConfig, actor: Actor, supply: BatchSupply, weight_sync: WeightSync,
                 source: RolloutSource, logger: MetricsLogger, strategy: Any, *, ref: Reference | None = None,
                 critic: Critic | None = None, eval_prompts: Any = None, teacher: Teacher | None = None):
        self.cfg = cfg
        self.actor, self.ref, self.critic, self.teacher = actor, ref, critic, teacher
        self.supply = supply
        self.weight_sync = weight_sync
        self.source = source
        self.logger = logger
        self.strategy = strategy
        self.eval_prompts = eval_prompts
        a = cfg.algo
        self.kl_ctl = make_kl_controller(a.init_kl_coef, a.kl_target, a.kl_horizon)
        self._last_rollouts: list[dict[str, Any]] = []
        self.doctor = make_doctor(cfg.doctor)  # None with --doctor off

    # -- the loop's side (rlhfkit.run.loop.Trainer) ----------------------------------------------------------
    def steps_per_epoch(self) -> int:
        return self.source.steps_per_episode()

    def start(self, state: LoopState) -> None:
        self.weight_sync.sync()  # the engines start from the actor's weights (also a resumed actor's)

    def next_work(self, state: LoopState) -> Rollout | None:
        return self.supply.next_rollout(state)

    def step(self, work: Rollout, state: LoopState) -> dict[str, float]:
        """Finish the rollout, train on it, sync the weights: RL step `state.global_step + 1`."""
        step = state.global_step
        exp, metrics = self.finish_experience(work, step)
        metrics.update(work.extra_metrics)
        self._last_rollouts = work.report_rows(self.source.tokenizer)  # agent episodes: with their traces
        pause_point("mid", step + 1)
        metrics = self.train(exp, metrics, step, work.started)
        if self.doctor is not None:
            report_alarms(self.doctor.observe(step + 1, metrics), self.strategy.print, self.logger.log)
        return metrics

    def progress_fields(self, metrics: dict[str, float]) -> dict[str, float]:
        return {"reward": metrics["reward"], "len": metrics["response_length"], "kl": metrics["kl"],
                "pg": metrics.get("actor/policy_loss", 0.0)}

    def report_rows(self) -> list[dict[str, Any]]:
        return self._last_rollouts

    def extra_state(self) -> dict[str, Any]:
        return {"kl_coef": self.kl_ctl.value}

    def load_extra_state(self, saved: dict[str, Any]) -> None:
        self.kl_ctl.value = saved["kl_coef"]

    def close(self) -> None:
        self.supply.close()

    # -- experience ------------------------------------------------------------------------------------------
    def finish_experience(self, rollout: Rollout, step: int) -> tuple[Experience, dict[str, float]]:
        """A generated and scored batch -> reference / critic / old-policy forwards, shaped rewards, advantages
        and returns, and the step's metrics (`step`: finished steps); with a teacher, its scores of the samples.
        The old policy is the actor as it is now, also for a batch an older policy sampled (async): the sampling
        policy's log-probs are the rollout log-probs, for the IS correction."""
        exp, timings = rollout.experience, rollout.timings
        started = time.perf_counter()
        batch = exp.to_dict()
        exp.base_action_log_probs = self.ref.log_probs(batch) if self.ref is not None else None
        exp.values = self.critic.values(batch) if self.critic is not None else None
        if self.teacher is not None:  # on-policy distillation: the teacher scores every sampled token
            scores = self.teacher.score(batch)
            exp.teacher_log_probs, exp.teacher_topk_ids, exp.teacher_topk_log_probs = (
                scores.get(k) for k in ("log_probs", "topk_ids", "topk_log_probs"))
        reuse_old = reuses_old_log_probs(self.cfg, self.ref is not None, len(exp), step)
        old_log_probs = exp.action_log_probs = None if reuse_old else self.actor.log_probs(batch)
        timings["time/score_s"] = timings.get("time/score_s", 0.0) + time.perf_counter() - started
        raw = rollout.reward["rewards"]
        shaped, shaping_metrics = shape_rewards(self.cfg, raw, exp.info["response_length"], exp.info["truncated"])
        rollout.recipe_metrics.update(shaping_metrics)
        bounds = reward_clip_bounds(self.cfg)
        rewards = exp.rewards = shaped.clamp(*bounds) if bounds else shaped.clone()
        exp.info.update(reward=raw, score=rollout.reward["scores"])
        advantages, returns = add_advantages(self.cfg, exp, rewards, old_log_probs, self.kl_ctl.value)
        metrics = experience_metrics(exp, rollout, advantages, returns, old_log_probs, self.kl_ctl.value)
        n = self.cfg.rollout.n_samples_per_prompt
        if n > 1 and len(raw) % n == 0:  # a group per prompt (the doctor's all-equal-groups alarm)
            metrics["reward_groups_all_equal"] = equal_reward_share(raw, n)
        return exp, metrics

    # -- updates ---------------------------------------------------------------------------------------------
    def train(self, exp: Experience, metrics: dict[str, float], step: int, started: float) -> dict[str, float]:
        """Critic and actor updates of RL step `step` (0-based) on a finished experience, then the weight sync,
        the KL controller and the step's timing metrics (`started`: when the step's work began)."""
        batch = exp.to_dict()
        seed = self.cfg.strategy.seed * SEED_STRIDE + step
        logged = (step + 1) % self.cfg.logging.logging_steps == 0
        train_started = time.perf_counter()
        if self.critic is not None:
            metrics.update({f"critic/{k}": v for k, v in self.critic.train(batch, seed=seed).items()})
        actor_trains = step + 1 > self.cfg.algo.freezing_actor_steps
        if actor_trains:
            actor_metrics = self.actor.train(batch, kl_coef=self.kl_ctl.value, seed=seed, entropy_metric=logged)
            for name in ("kl", "rollout_logprob_diff"):  # from the training forward when it gave the old log-probs
                if f"old_{name}" in actor_metrics:
                    metrics[name] = actor_metrics.pop(f"old_{name}")
            metrics.update({f"actor/{k}": v for k, v in actor_metrics.items()})
        metrics["time/train_s"] = time.perf_counter() - train_started
        sync_started = time.perf_counter()
        if actor_trains:
            metrics.update(self.weight_sync.sync() or {})  # sync/bytes: what moved to each engine
        metrics["time/sync_s"] = time.perf_counter() - sync_started
        self.kl_ctl.update(metrics["kl"], len(exp))
        metrics["time/step_s"] = time.perf_counter() - started
        # Throughput counts every non-pad token the step processed (prompts and responses) and, separately, the
        # response tokens the policy loss is taken over.
        metrics["tokens_per_s"] = float(exp.attention_mask.sum()) / metrics["time/step_s"]
        metrics["response_tokens_per_s"] = float(exp.action_mask.sum()) / metrics["time/step_s"]
        return metrics

    # -- evaluation ------------------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, step: int) -> dict[str, float] | None:
        """Mean reward and pass@1 (mean score, in [0, 1] for 0/1 rewards) on the held-out prompts, logged under
        eval/; None without them."""
        if not self.eval_prompts:
            return None
        r = self.cfg.rollout
        n = 1 if r.eval_temperature == 0 else r.eval_n_samples_per_prompt
        started = time.perf_counter()
        exp, texts = self.source.sample(self.eval_prompts, range(len(self.eval_prompts)), n, r.eval_temperature,
                                        seed=self.cfg.strategy.seed, key=1)
        reward = self.source.score(exp, texts)
        scores = reward["scores"]
        metrics = {"reward": _mean(reward["rewards"]), "pass@1": _mean(scores.clamp(0, 1)),
                   "response_length": _mean(exp.info["response_length"]), "time_s": time.perf_counter() - started}
        if n > 1:
            metrics[f"pass@{n}"] = _mean(scores.clamp(0, 1).reshape(-1, n).amax(dim=1))
        self.logger.log(step, metrics, prefix="eval")
        self.strategy.print(f"eval @ step {step}: reward {metrics['reward']:.4f}, pass@1 {metrics['pass@1']:.4f}")
        if self.doctor is not None:
            report_alarms(self.doctor.observe_eval(step, metrics), self.strategy.print, self.logger.log)
        return metrics

    # -- what is saved -------------------------------------------------------------------------------------------
    def checkpoint_targets(self) -> dict[str, Any]:
        """Roles with DeepSpeed-engine-like save_checkpoint / load_checkpoint methods."""
        targets: dict[str, Any] = {"actor": self.actor}
        if self.critic is not None:
            targets["critic"] = self.critic
        return targets

    def save_best(self, path: str) -> None:
        """The policy as it is now, as a Transformers model (--best_metric_key)."""
        self.actor.save_hf_model(path)

    def save_final(self) -> None:
        """The trained policy (and with --save_value_network the critic) as Transformers models."""
        c = self.cfg.checkpoint
        self.actor.save_hf_model(c.save_path)
        if self.cfg.save.save_value_network and self.critic is not None:
            self.critic.save_hf_model(c.save_path.rstrip("/") + "_critic")
