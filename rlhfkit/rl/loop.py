"""The RL run's driver: the RL trainer (`rlhfkit.rl.trainer.RLTrainer`) on the loop skeleton every trainer shares
(`rlhfkit.run.loop.TrainingLoop`: resume, the first weight sync, progress, logging, report samples, evaluation per
--eval_steps or per episode, the best policy, checkpoints, preemption), with the RL settings (`rl_settings`).

One loop for PPO, REINFORCE++, REINFORCE++-baseline, GRPO, Dr. GRPO and RLOO, synchronous or asynchronous, local or
on Ray. What varies between runs is only what the runner hands the trainer (`RLTrainer`'s arguments):
- the role handles (`RoleHandles`): local objects (train_ppo, `local_run.py`) or Ray actor groups and engine actors
  (train_ppo_ray, `ray_run.py`);
- the batch supply: the run's `rollout_source.RolloutSource` itself (synchronous), or the generator actor's queue
  (`async_driver.GeneratorQueue`, --async_train);
- the weight sync: `weight_sync.LocalWeightSync`, `weight_sync.RayWeightSync`, or a Ray sync under the generator's
  lock (`async_driver.LockedWeightSync`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from rlhfkit.config.rl import PPOConfig
from rlhfkit.rl.role_protocols import Actor, Critic, Reference, Reward, Teacher
from rlhfkit.rollout.engine import RolloutEngine
from rlhfkit.run.loop import LoopSettings


class EpisodeEngine(RolloutEngine, Protocol):
    """A runner's rollout engine: a `RolloutEngine` that also runs agent episodes (--agent_func_path), as the
    rollout source needs (`rollout_source.SamplingEngine`)."""

    def generate_episodes(self, requests: Sequence[dict[str, Any]], agent_path: str,
                          **kwargs: Any) -> list[dict[str, Any]]: ...


@dataclass
class RoleHandles:
    """What a runner builds (interfaces in `role_protocols.py`). Each is a local role object or a Ray actor group
    with the same methods; the reward may also be a text reward source, or None when agent episodes bring their
    rewards."""

    actor: Actor
    engine: EpisodeEngine
    reward: Reward | None
    ref: Reference | None = None
    critic: Critic | None = None
    teacher: Teacher | None = None  # on-policy distillation


def rl_settings(cfg: PPOConfig) -> LoopSettings:
    """The cadence of an RL run: --num_episodes passes over the prompts (capped by --max_rl_steps), evaluation
    after each episode by default and once more when --max_rl_steps ends the run inside one, checkpoints whose
    state.json names the pass `episode`."""
    return LoopSettings(name=cfg.algo.advantage_estimator, max_epochs=cfg.rollout.num_episodes,
                        max_steps=cfg.rollout.max_rl_steps, logging=cfg.logging, checkpoint=cfg.checkpoint,
                        best_metric_key=cfg.save.best_metric_key, eval_at_end=True, pass_name="episode")

