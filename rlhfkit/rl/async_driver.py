"""Asynchronous RL (`--async_train`): the Ray run's loop with generation moved to a generator actor.

`with_async_training(RayRLTrainer)` is `RayRLTrainer` with three methods replaced (the `AsyncTraining` mixin);
the loop (`RLTrainer._fit`), the experience pieces (`finish_experience`) and the update (`train_on`) are the
synchronous ones:
- `next_rollout`: the next batch from the generator's bounded queue (`async_generator.RolloutGenerator`, started
  after resume and the first weight sync), adopting the data position it was drawn at;
- `train_step`: reference / critic / old-policy forwards on that batch, then the same training as a synchronous
  step. The old policy is the actor's current weights (recomputed, not the sampler's), so with one optimizer step
  per batch the training forward gives them exactly, stale batch or not (`RLTrainer.reuses_old_log_probs`); the
  rollout log-probs of the older sampling policy stay for the IS correction;
- `sync_weights`: the weight update under the generator's lock, bumping the policy version.
Metrics: `async/staleness` (trainer version minus the oldest sampling version of the batch, at most
--async_queue_size), `async/staleness_mean`, `async/mixed_version_samples` (partial rollout), `async/wait_s` (the
trainer waiting for a batch), `async/queued` (batches left in the queue).

Resume: checkpoints store the position of the last *consumed* batch (RLState); batches still queued are dropped
with the generator and regenerated after a resume (with the resumed policy), so no prompt is skipped or trained on
twice.
"""

from __future__ import annotations

import time
from typing import Any

from rlhfkit.distributed.placement import unwrap_user_error
from rlhfkit.distributed.ray_groups import kill_actors, ray_get, worker_env
from rlhfkit.errors import ComponentFailed
from rlhfkit.rl.experience import Experience

GENERATOR = "the rollout generator"
GENERATOR_CONCURRENCY = 4  # next_batch, begin/end_weight_update, stats, stop may overlap the producer thread


def with_async_training(base: type) -> type:
    """`base` (an RLTrainer whose sync_weights updates the engines of a Ray run) fed by a generator actor."""
    return type(f"Async{base.__name__}", (AsyncTraining, base), {})


class AsyncTraining:
    """Mixin over an RLTrainer (see the module docstring); `with_async_training` puts it first in the MRO."""

    cfg: Any
    state: Any
    prompts: Any
    roles: Any

    def __init__(self, *args: Any, reward_handle: Any = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.reward_handle = reward_handle  # a reward-model group, or None: the generator builds the text reward
        self.generator: Any = None
        self.generator_pid: int | None = None
        self.policy_version = 0
        self.last_generator_stats: dict[str, Any] | None = None  # lock intervals, kept when the generator stops
        self.consumed: list[dict[str, Any]] = []  # per step: trainer version and the batch's sampling versions
        self.trained_prompts: list[str] = []  # per sample, in training order

    # -- the generator ----------------------------------------------------------------------------------------
    def start_generator(self) -> None:
        import ray

        remote = ray.remote(num_cpus=0, max_concurrency=GENERATOR_CONCURRENCY)(_generator_class())
        self.generator = remote.remote(self.cfg, ray.put(list(self.prompts)), self.roles.engine,
                                       self.reward_handle, worker_env())
        s = self.state
        self.policy_version = s.global_step
        self.generator_pid = ray_get(self.generator.start.remote(s.episode, s.batch_in_episode, s.global_step,
                                                                 self.policy_version), GENERATOR)

    def stop_generator(self) -> None:
        if self.generator is None:
            return
        try:
            self.last_generator_stats = ray_get(self.generator.stats.remote(), GENERATOR, timeout=60)
            ray_get(self.generator.stop.remote(), GENERATOR, timeout=60)
        except Exception:  # noqa: BLE001 - best effort: the actor is killed below whatever happened
            pass
        kill_actors([self.generator])
        self.generator = None

    def generator_stats(self) -> dict[str, Any]:
        return ray_get(self.generator.stats.remote(), GENERATOR)

    def fit(self) -> list[dict[str, float]]:
        try:
            return super().fit()
        finally:
            self.stop_generator()

    # -- the loop's pieces ------------------------------------------------------------------------------------
    def next_rollout(self) -> dict[str, Any] | None:
        if self.generator is None:
            self.start_generator()
        import ray

        started = time.perf_counter()
        try:
            item = ray_get(self.generator.next_batch.remote(), GENERATOR)
        except ray.exceptions.RayTaskError as e:  # the generator's own error (e.g. a failing reward function)
            cause = unwrap_user_error(e)
            if cause is not e:
                raise cause from None
            raise ComponentFailed(f"{GENERATOR} failed: {type(e.cause).__name__}: {e.cause}") from None
        if item is None:
            return None
        item["wait_s"] = time.perf_counter() - started
        self.state.episode, self.state.batch_in_episode = item["position"]  # only consumed batches count
        return item

    def train_step(self, item: dict[str, Any]) -> dict[str, float]:
        step_started = time.perf_counter() - item["wait_s"]
        exp = Experience.from_dict(item["experience"])
        oldest = int(exp.info["policy_version"].min())
        newest = exp.info["policy_version_max"]
        lag = self.policy_version - exp.info["policy_version"]
        self.consumed.append({"step": self.state.global_step + 1, "trainer_version": self.policy_version,
                              "sample_version": oldest, "sample_version_max": int(newest.max()),
                              "position": tuple(item["position"])})
        self.trained_prompts.extend(item["texts"]["prompts"])
        exp, metrics = self.finish_experience(exp, item["texts"], item["reward"], item["recipe_metrics"],
                                              dict(item["timings"]))
        self.consumed[-1]["old_log_probs_from_actor_forward"] = exp.action_log_probs is not None
        metrics.update({"async/staleness": float(lag.max()), "async/staleness_mean": float(lag.float().mean()),
                        "async/mixed_version_samples": float((newest > exp.info["policy_version"]).float().mean()),
                        "async/wait_s": item["wait_s"], "async/queued": float(item["queued_after"])})
        return self.train_on(exp, metrics, step_started)

    def sync_weights(self) -> None:
        if self.generator is None:  # the first sync (and the one after a resume) runs before the generator starts
            super().sync_weights()
            return
        ray_get(self.generator.begin_weight_update.remote(), f"{GENERATOR} (waiting to update weights)")
        try:
            super().sync_weights()
        finally:
            self.policy_version += 1
            ray_get(self.generator.end_weight_update.remote(self.policy_version), GENERATOR)


def _generator_class() -> type:
    from rlhfkit.rl.async_generator import RolloutGenerator

    return RolloutGenerator
