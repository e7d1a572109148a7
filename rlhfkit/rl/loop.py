"""The RL loop: one loop for PPO, REINFORCE++, REINFORCE++-baseline, GRPO, Dr. GRPO and RLOO.

One step, as data (docs/architecture.md, "One RL step through the folders"):
    rollout_batch_size prompts, each repeated n_samples_per_prompt times (a prompt's samples adjacent)
    -> engine.generate (responses, rollout log-probs)
    -> scoring: reward.score, ref.log_probs, critic.values, actor.log_probs (old policy)
    -> reward clipping, per-token KL, compute_advantages(--advantage_estimator)   (rlhfkit.algorithms)
    -> critic.train, actor.train (replay buffer of micro-batches inside each role)
    -> engine.update_weights(actor.state_dict())
    -> metrics, evaluation, checkpoint
The estimators differ only inside `compute_advantages` (and Dr. GRPO's loss aggregation, in the actor). The loop
holds role *handles* (`RoleHandles`) and calls only their methods with CPU tensors, lists and dicts: local objects
here, Ray actor groups with the same methods when distributed.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from rlhfkit.algorithms.advantages import compute_advantages
from rlhfkit.algorithms.kl import compute_approx_kl, make_kl_controller
from rlhfkit.algorithms.masking import masked_mean
from rlhfkit.config.rl import PPOConfig, reward_clip_bounds
from rlhfkit.data.sampler import global_batches
from rlhfkit.data.tokens import encode, with_bos
from rlhfkit.errors import Preempted, UserError
from rlhfkit.logging.metrics import MetricsLogger, Progress
from rlhfkit.rl.experience import Experience, experience_from_samples
from rlhfkit.rl.replay_buffer import one_optimizer_step
from rlhfkit.rl.role_protocols import Actor, Critic, Reference, Reward
from rlhfkit.rl.shaping import fill_filtered_batch, shape_rewards
from rlhfkit.rollout.engine import RolloutEngine
from rlhfkit.run.checkpoint import resume, save_checkpoint
from rlhfkit.run.pause_points import pause_point
from rlhfkit.run.preemption import PreemptionWatch, preemption_message
from rlhfkit.run.runs import RunInfo


@dataclass
class RoleHandles:
    """What the loop drives (interfaces in `role_protocols.py`). Each is a local role object or a Ray actor group
    with the same methods; the reward may also be a text reward source, or None when agent episodes bring their
    rewards."""

    actor: Actor
    engine: RolloutEngine
    reward: Reward | None
    ref: Reference | None = None
    critic: Critic | None = None


def best_model_path(cfg: PPOConfig) -> str:
    """Where --best_metric_key exports the best policy: <save_path>/best."""
    return os.path.join(cfg.checkpoint.save_path, "best")


@dataclass
class RLState:
    """Where training is; saved in checkpoints so a resumed run continues the same data order."""

    episode: int = 0
    batch_in_episode: int = 0
    global_step: int = 0
    kl_coef: float = 0.0
    best_metric: float | None = None  # --best_metric_key: the best value so far (its model is in <save_path>/best)


REPORT_ROLLOUT_STEPS = 5  # the run report shows rollouts of the first and last step and of about this many more
REPORT_ROLLOUTS_PER_STEP = 4


def _report_rows(texts: dict[str, list], rewards: torch.Tensor) -> list[dict[str, Any]]:
    """The first few (prompt, response, reward) of a rollout batch, for the run report."""
    rows = []
    for prompt, query, reward in zip(texts["prompts"], texts["queries"], rewards.tolist()):
        rows.append({"prompt": prompt, "response": query[len(prompt):], "reward": reward})
        if len(rows) == REPORT_ROLLOUTS_PER_STEP:
            break
    return rows


def _mean(t: torch.Tensor) -> float:
    return float(t.float().mean()) if t.numel() else 0.0


def _std(t: torch.Tensor) -> float:
    return float(t.float().std(unbiased=False)) if t.numel() > 1 else 0.0


class RLTrainer:
    def __init__(self, cfg: PPOConfig, roles: RoleHandles, tokenizer: Any, prompts: Sequence[dict],
                 eval_prompts: Sequence[dict] | None, logger: MetricsLogger, strategy: Any,
                 run: RunInfo | None = None):
        self.cfg = cfg
        self.run = run or RunInfo("ppo")  # identity written into (and checked against) the checkpoints
        self.roles = roles
        self.tokenizer = tokenizer
        self.prompts = prompts
        self.eval_prompts = eval_prompts
        self.logger = logger
        self.strategy = strategy  # rank / barrier / RNG capture for checkpoints (the driver's)
        a = cfg.algo
        self.kl_ctl = make_kl_controller(a.init_kl_coef, a.kl_target, a.kl_horizon)
        self.state = RLState(kl_coef=self.kl_ctl.value)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self._prompt_ids: dict[tuple[int, int], list[int]] = {}
        self._last_eval_step = -1
        self._last_rollouts: list[dict[str, Any]] = []

    # -- sizes ----------------------------------------------------------------------------------------------
    def steps_per_episode(self) -> int:
        return len(self.prompts) // self.cfg.rollout.rollout_batch_size

    def total_steps(self) -> int:
        """RL steps this run trains (--max_rl_steps caps the --num_episodes passes)."""
        steps = self.steps_per_episode() * self.cfg.rollout.num_episodes
        return steps if self.cfg.rollout.max_rl_steps < 0 else min(steps, self.cfg.rollout.max_rl_steps)

    # -- prompts --------------------------------------------------------------------------------------------
    def prompt_ids(self, dataset: Sequence[dict], index: int, key: int = 0) -> list[int]:
        """Token ids of a prompt: bos + prompt text, left-truncated to --prompt_max_len (cached)."""
        cached = self._prompt_ids.get((key, index))
        if cached is None:
            ids = with_bos(self.tokenizer, encode(self.tokenizer, dataset[index]["prompt"]))
            cached = ids[-self.cfg.data.prompt_max_len:]
            self._prompt_ids[(key, index)] = cached
        return cached

    def sample(self, dataset: Sequence[dict], indices: Sequence[int], n: int, temperature: float, seed: int,
               key: int = 0) -> tuple[Experience, dict[str, list]]:
        """Generate n responses per prompt (adjacent) and pad them into an Experience plus the texts."""
        r = self.cfg.rollout
        ids, prompts, labels = [], [], []
        for i in indices:
            record = dataset[i]
            for _ in range(n):
                ids.append(self.prompt_ids(dataset, i, key))
                prompts.append(record["prompt"])
                labels.append(record.get("label"))
        sampling = dict(temperature=temperature, top_p=r.top_p if temperature > 0 else 1.0,
                        top_k=r.top_k if temperature > 0 else -1, seed=seed)
        agent = self.cfg.agent.agent_func_path
        episode_reward = None
        self.roles.engine.wake()
        if agent:  # multi-turn episodes run inside the engine(s); their step rewards are the reward
            from rlhfkit.agents.episodes import episodes_to_samples

            requests = [{"prompt": p, "prompt_ids": i, "label": lab} for p, i, lab in zip(prompts, ids, labels)]
            code = self.cfg.user_code
            episodes = self.roles.engine.generate_episodes(requests, agent, max_steps=self.cfg.agent.max_steps,
                                                           max_length=self.cfg.data.generate_max_len,
                                                           step_timeout=code.reward_timeout,
                                                           agent_workers=code.reward_workers, **sampling)
            samples, episode_reward = episodes_to_samples(episodes, code.reward_fallback,
                                                          code.max_reward_failure_ratio, f"agent {agent}", prompts)
        else:
            samples = self.roles.engine.generate(ids, max_new_tokens=self.cfg.data.generate_max_len, **sampling)
        self.roles.engine.sleep()
        experience = experience_from_samples(samples, self.pad_id)
        responses = self.tokenizer.batch_decode([s.response_ids for s in samples], skip_special_tokens=False)
        queries = [p + resp for p, resp in zip(prompts, responses)]
        texts: dict[str, Any] = {"queries": queries, "prompts": prompts, "labels": labels}
        if episode_reward is not None:
            texts["episode_reward"] = episode_reward
        return experience, texts

    def score(self, experience: Experience, texts: dict[str, Any]) -> dict[str, Any]:
        out = texts.get("episode_reward") or self.roles.reward.score({**experience.to_dict(), **texts})
        return {"rewards": torch.as_tensor(out["rewards"]).float().reshape(-1),
                "scores": torch.as_tensor(out.get("scores", out["rewards"])).float().reshape(-1),
                "extra_logs": dict(out.get("extra_logs") or {}),
                "metrics": dict(out.get("metrics") or {})}  # e.g. reward/failures of a reward function file

    # -- one step -------------------------------------------------------------------------------------------
    def _generate_and_score(self, indices: Sequence[int], seed: int, timings: dict[str, float]
                            ) -> tuple[Experience, dict[str, list], dict[str, Any]]:
        started = time.perf_counter()
        exp, texts = self.sample(self.prompts, indices, self.cfg.rollout.n_samples_per_prompt,
                                 self.cfg.rollout.temperature, seed=seed)
        timings["time/generate_s"] = timings.get("time/generate_s", 0.0) + time.perf_counter() - started
        started = time.perf_counter()
        reward = self.score(exp, texts)
        timings["time/score_s"] = timings.get("time/score_s", 0.0) + time.perf_counter() - started
        return exp, texts, reward

    def _next_prompts(self) -> list[int] | None:
        """The next rollout batch of prompt indices from the stream, advancing the data position (RLState), or
        None when every episode is used up. An episode is finished lazily, so a checkpoint saved after its last
        batch resumes into the next one."""
        r = self.cfg.rollout
        if self.state.batch_in_episode >= self.steps_per_episode():
            self.state.episode += 1
            self.state.batch_in_episode = 0
        if self.state.episode >= r.num_episodes:
            return None
        batches = global_batches(len(self.prompts), r.rollout_batch_size, self.cfg.strategy.seed, self.state.episode)
        indices = batches[self.state.batch_in_episode]
        self.state.batch_in_episode += 1
        return indices

    def next_rollout(self) -> Any:
        """What the next `train_step` works on (here the next prompts; async training: a generated batch), or None
        when the data is used up."""
        return self._next_prompts()

    def _rollout(self, indices: Sequence[int], timings: dict[str, float]
                 ) -> tuple[Experience, dict[str, list], dict[str, Any], dict[str, float]]:
        """Generate and score a batch; with --dynamic_filtering, drop the groups whose mean score is outside the
        range and generate from the next prompts of the stream until rollout_batch_size groups are kept (at most
        --dynamic_filtering_max_rounds rounds). Returns the kept experience, texts, reward dict and metrics."""
        cfg = self.cfg
        seed = cfg.strategy.seed * 1_000_003 + self.state.global_step
        exp, texts, reward = self._generate_and_score(indices, seed, timings)
        if not cfg.recipe.dynamic_filtering:
            return exp, texts, reward, {}

        def generate(round_: int) -> tuple[Experience, dict[str, Any], dict[str, Any]] | None:
            more = self._next_prompts()
            return None if more is None else self._generate_and_score(more, seed + round_ * 1_000_000_007, timings)

        return fill_filtered_batch(cfg, exp, texts, reward, generate)

    def make_experience(self, indices: Sequence[int]) -> tuple[Experience, dict[str, float]]:
        """Rollout and scoring of one batch of prompts, with advantages and returns computed."""
        timings: dict[str, float] = {}
        exp, texts, reward, recipe_metrics = self._rollout(indices, timings)
        return self.finish_experience(exp, texts, reward, recipe_metrics, timings)

    def finish_experience(self, exp: Experience, texts: dict[str, Any], reward: dict[str, Any],
                          recipe_metrics: dict[str, float], timings: dict[str, float]
                          ) -> tuple[Experience, dict[str, float]]:
        """A generated and scored batch -> reference / critic / old-policy forwards, shaped rewards, advantages
        and returns, and the step's metrics. The old policy is the actor as it is now, also for a batch an older
        policy sampled (async): the sampling policy's log-probs are the rollout log-probs, for the IS correction."""
        cfg, a, n = self.cfg, self.cfg.algo, self.cfg.rollout.n_samples_per_prompt
        started = time.perf_counter()
        batch = exp.to_dict()
        exp.base_action_log_probs = self.roles.ref.log_probs(batch) if self.roles.ref is not None else None
        exp.values = self.roles.critic.values(batch) if self.roles.critic is not None else None
        reuse_old = self.reuses_old_log_probs(len(exp))
        exp.action_log_probs = None if reuse_old else self.roles.actor.log_probs(batch)
        timings["time/score_s"] = timings.get("time/score_s", 0.0) + time.perf_counter() - started

        mask = exp.action_mask
        raw = reward["rewards"]
        shaped, shaping_metrics = shape_rewards(cfg, raw, exp.info["response_length"], exp.info["truncated"])
        recipe_metrics.update(shaping_metrics)
        bounds = reward_clip_bounds(cfg)
        exp.rewards = shaped.clamp(*bounds) if bounds else shaped.clone()
        exp.info.update(reward=raw, score=reward["scores"])
        if exp.base_action_log_probs is not None and not reuse_old:
            exp.kl = compute_approx_kl(exp.action_log_probs, exp.base_action_log_probs, a.kl_estimator, mask)
        exp.advantages, exp.returns = compute_advantages(
            a.advantage_estimator, rewards=exp.rewards, action_mask=mask,
            token_kl=exp.kl if a.init_kl_coef > 0 else None, values=exp.values, n_samples_per_prompt=n,
            gamma=a.gamma, lambd=a.lambd, kl_coef=self.kl_ctl.value, use_kl_loss=a.use_kl_loss,
            std_norm=not a.no_advantage_std_norm)
        self._last_rollouts = _report_rows(texts, raw)
        kl_per_sample = masked_mean(exp.kl, mask, dim=-1) if exp.kl is not None else torch.zeros(len(exp))
        lengths = exp.info["response_length"]
        metrics = {
            "reward": _mean(raw), "reward_std": _std(raw), "score": _mean(reward["scores"]),
            "response_length": _mean(lengths), "response_length_max": float(lengths.max()),
            "truncated": _mean(exp.info["truncated"]), "kl": _mean(kl_per_sample), "kl_coef": self.kl_ctl.value,
            "advantage_abs": float(masked_mean(exp.advantages.abs(), mask)),
            "return": float(masked_mean(exp.returns, mask)),
            **({} if reuse_old else {"rollout_logprob_diff": float(
                masked_mean((exp.action_log_probs - exp.rollout_log_probs).abs(), mask))}),
            **{f"reward_extra/{k}": float(v) for k, v in reward["extra_logs"].items()}, **reward["metrics"],
            **recipe_metrics, **timings,
        }
        return exp, metrics

    def reuses_old_log_probs(self, samples: int) -> bool:
        """Whether this step leaves the old-policy log-probs to the actor's training forward instead of an extra
        actor forward: the actor makes one optimizer step on the rollout (so its weights are still the rollout's
        old policy during that step; `roles.reused_old_log_probs`), and no KL penalty needs them in the rewards
        before training (no reference, --init_kl_coef 0, or the KL as a loss: --use_kl_loss)."""
        a = self.cfg.algo
        kl_in_reward = self.roles.ref is not None and a.init_kl_coef > 0 and not a.use_kl_loss
        actor_trains = self.state.global_step + 1 > a.freezing_actor_steps
        one_step = one_optimizer_step(samples, self.cfg.strategy.train_batch_size, self.cfg.rollout.max_epochs)
        return actor_trains and not kl_in_reward and one_step

    def train_step(self, indices: Any) -> dict[str, float]:
        """One RL step on the prompts `indices` (from `next_rollout`): rollout, scoring, training, weight sync."""
        step_started = time.perf_counter()
        exp, metrics = self.make_experience(indices)
        return self.train_on(exp, metrics, step_started)

    def train_on(self, exp: Experience, metrics: dict[str, float], step_started: float) -> dict[str, float]:
        """Critic and actor updates on a finished experience, then the weight sync and the step's metrics."""
        pause_point("mid", self.state.global_step + 1)
        batch = exp.to_dict()
        seed = self.cfg.strategy.seed * 1_000_003 + self.state.global_step
        logged = (self.state.global_step + 1) % self.cfg.logging.logging_steps == 0
        started = time.perf_counter()
        if self.roles.critic is not None:
            metrics.update({f"critic/{k}": v for k, v in self.roles.critic.train(batch, seed=seed).items()})
        actor_trains = self.state.global_step + 1 > self.cfg.algo.freezing_actor_steps
        if actor_trains:
            actor_metrics = self.roles.actor.train(batch, kl_coef=self.kl_ctl.value, seed=seed,
                                                   entropy_metric=logged)
            for name in ("kl", "rollout_logprob_diff"):  # from the training forward when it gave the old log-probs
                if f"old_{name}" in actor_metrics:
                    metrics[name] = actor_metrics.pop(f"old_{name}")
            metrics.update({f"actor/{k}": v for k, v in actor_metrics.items()})
        metrics["time/train_s"] = time.perf_counter() - started
        started = time.perf_counter()
        if actor_trains:
            self.sync_weights()
        metrics["time/sync_s"] = time.perf_counter() - started
        self.kl_ctl.update(metrics["kl"], len(exp))
        self.state.kl_coef = self.kl_ctl.value
        metrics["time/step_s"] = time.perf_counter() - step_started
        # Throughput counts every non-pad token the step processed (prompts and responses) and, separately, the
        # response tokens the policy loss is taken over.
        metrics["tokens_per_s"] = float(exp.attention_mask.sum()) / metrics["time/step_s"]
        metrics["response_tokens_per_s"] = float(exp.action_mask.sum()) / metrics["time/step_s"]
        return metrics

    def sync_weights(self) -> None:
        """Actor -> rollout engine (after every actor update, and at start and resume)."""
        self.roles.engine.update_weights(self.roles.actor.state_dict())

    # -- the loop -------------------------------------------------------------------------------------------
    def fit(self) -> list[dict[str, float]]:
        """Train; on SIGTERM save a checkpoint at the next step boundary and raise Preempted (the CLI exits 0)."""
        with PreemptionWatch(self.strategy) as self._preemption:
            return self._fit()

    def _fit(self) -> list[dict[str, float]]:
        cfg, log = self.cfg, self.cfg.logging
        if cfg.checkpoint.load_checkpoint:
            self.resume()
        self.sync_weights()
        total = self.total_steps()
        history: list[dict[str, float]] = []
        bar = Progress(total, self.state.global_step, cfg.algo.advantage_estimator,
                       self.strategy.is_rank0 and not log.disable_progress_bar)
        while self.state.global_step < total:
            pause_point("between", self.state.global_step)
            work = self.next_rollout()
            if work is None:
                break
            metrics = self.train_step(work)
            self.state.global_step += 1
            step = self.state.global_step
            history.append(metrics)
            if step % log.logging_steps == 0:
                self.logger.log(step, metrics)
            if step == 1 or step == total or step % max(total // REPORT_ROLLOUT_STEPS, 1) == 0:
                self.logger.log_samples(step, self._last_rollouts)
            bar.update({"reward": metrics["reward"], "len": metrics["response_length"], "kl": metrics["kl"],
                        "pg": metrics.get("actor/policy_loss", 0.0)})
            episode_done = self.state.batch_in_episode >= self.steps_per_episode()
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
        if log.eval_steps < 0 and self._last_eval_step != self.state.global_step:
            self.evaluate(self.state.global_step)  # --max_rl_steps ended the run inside an episode
        bar.close()
        return history

    @torch.no_grad()
    def evaluate(self, step: int) -> dict[str, float] | None:
        """Mean reward and pass@1 (mean score, in [0, 1] for 0/1 rewards) on the held-out prompts."""
        if not self.eval_prompts:
            return None
        self._last_eval_step = step
        r = self.cfg.rollout
        n = 1 if r.eval_temperature == 0 else r.eval_n_samples_per_prompt
        started = time.perf_counter()
        exp, texts = self.sample(self.eval_prompts, range(len(self.eval_prompts)), n, r.eval_temperature,
                                 seed=self.cfg.strategy.seed, key=1)
        reward = self.score(exp, texts)
        scores = reward["scores"]
        metrics = {"reward": _mean(reward["rewards"]), "pass@1": _mean(scores.clamp(0, 1)),
                   "response_length": _mean(exp.info["response_length"]), "time_s": time.perf_counter() - started}
        if n > 1:
            metrics[f"pass@{n}"] = _mean(scores.clamp(0, 1).reshape(-1, n).amax(dim=1))
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
        if self.state.best_metric is not None and value <= self.state.best_metric:
            return
        self.state.best_metric = value
        path = best_model_path(self.cfg)
        self.roles.actor.save_hf_model(path)
        if self.strategy.is_rank0:
            with open(os.path.join(path, "best_metric.json"), "w") as f:
                json.dump({"metric": key, "value": value, "step": step}, f)

    # -- checkpoints ----------------------------------------------------------------------------------------
    def _checkpoint_targets(self) -> dict[str, Any]:
        """Roles with DeepSpeed-engine-like save_checkpoint / load_checkpoint methods."""
        targets = {"actor": self.roles.actor}
        if self.roles.critic is not None:
            targets["critic"] = self.roles.critic
        return targets

    def save_checkpoint(self) -> None:
        c = self.cfg.checkpoint
        state = asdict(self.state)
        state.pop("global_step")
        save_checkpoint(self.strategy, c.ckpt_path, self.state.global_step, self._checkpoint_targets(), state,
                        c.max_ckpt_num, max_gb=c.max_ckpt_mem, run=self.run)  # roles pick universal or not

    def resume(self) -> None:
        c = self.cfg.checkpoint
        found = resume(self.strategy, c.ckpt_path, self._checkpoint_targets(), self.run)
        if found is None:
            self.strategy.print(f"no checkpoint in {c.ckpt_path}; starting from scratch")
            return
        path, saved = found
        self.state = RLState(episode=saved["episode"], batch_in_episode=saved["batch_in_episode"],
                             global_step=saved["global_step"], kl_coef=saved["kl_coef"],
                             best_metric=saved.get("best_metric"))
        self.kl_ctl.value = self.state.kl_coef
        self.strategy.print(f"resumed from {path} at step {self.state.global_step}")

    def save_final(self) -> None:
        """The trained policy (and with --save_value_network the critic) as Transformers models."""
        c = self.cfg.checkpoint
        self.roles.actor.save_hf_model(c.save_path)
        if self.cfg.save.save_value_network and self.roles.critic is not None:
            self.roles.critic.save_hf_model(c.save_path.rstrip("/") + "_critic")
