"""Asynchronous RL (`--async_train`), the driver's side: the batch supply and the weight sync of an async run.

An async run is the synchronous trainer (`rlhfkit.rl.trainer.RLTrainer`) on the same loop (`rlhfkit.rl.loop`),
handed two different parts, nothing subclassed:
- the batch supply `GeneratorQueue`: the next batch from the generator actor's bounded queue
  (`async_generator.RolloutGenerator`, started after resume and the first weight sync, from the loop's data
  position), adopting the data position it was drawn at;
- the weight sync `LockedWeightSync`: the Ray weight sync under the generator's lock, bumping the policy version.
The trainer finishes each batch as a synchronous step does. The old policy is the actor's current weights
(recomputed, not the sampler's), so with one optimizer step per batch the training forward gives them exactly,
stale batch or not (`trainer.reuses_old_log_probs`); the rollout log-probs of the older sampling policy stay for the
IS correction.
Metrics: `async/staleness` (trainer version minus the oldest sampling version of the batch, at most
--async_queue_size), `async/staleness_mean`, `async/token_staleness_mean` (over the action tokens, each with the
version that sampled it), `async/mixed_version_samples` (partial rollout), `async/wait_s` (the trainer waiting for
a batch), `async/queued` (batches left in the queue). The run report's samples (samples.jsonl) carry each response
token's version (`policy_versions`).

Resume: checkpoints store the position of the last *consumed* batch (the loop's `LoopState`); batches still
queued are dropped with the generator and regenerated after a resume (with the resumed policy), so no prompt is
skipped or trained on twice.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from rlhfkit.config.rl import PPOConfig
from rlhfkit.distributed.placement import unwrap_user_error
from rlhfkit.distributed.ray_groups import kill_actors, ray_get, worker_env
from rlhfkit.errors import ComponentFailed
from rlhfkit.rl.async_generator import RolloutGenerator
from rlhfkit.rl.experience import Experience
from rlhfkit.rl.rollout_source import Rollout
from rlhfkit.rl.trainer import reuses_old_log_probs
from rlhfkit.rl.weight_sync import WeightSync
from rlhfkit.run.loop import LoopState

GENERATOR = "the rollout generator"
GENERATOR_CONCURRENCY = 4  # next_batch, begin/end_weight_update, stats, stop may overlap the producer thread


class GeneratorQueue:
    """The batch supply of an async run. The generator actor builds its own rollout source over `prompts`, `engine`
    (a Ray engine group) and `reward_handle` (a reward-model group, or None: the generator builds the text reward
    source); it starts at the loop's data position, and the loop adopts the position of each batch it takes (the
    consumed position, what checkpoints save). `has_reference` says whether a reference role exists (for the
    record of where each step's old log-probs came from)."""

    def __init__(self, cfg: PPOConfig, prompts: Sequence[dict], engine: Any, reward_handle: Any,
                 has_reference: bool):
        self.cfg = cfg
        self.prompts = prompts
        self.engine = engine
        self.reward_handle = reward_handle
        self.has_reference = has_reference
        self.generator: Any = None
        self.generator_pid: int | None = None
        self.policy_version = 0
        self.last_generator_stats: dict[str, Any] | None = None  # lock intervals, kept when the generator stops
        self.consumed: list[dict[str, Any]] = []  # per step: trainer version and the batch's sampling versions
        self.trained_prompts: list[str] = []  # per sample, in training order

    # -- the generator ----------------------------------------------------------------------------------------
    def _start(self, position: LoopState) -> None:
        import ray

        remote = ray.remote(RolloutGenerator).options(num_cpus=0, max_concurrency=GENERATOR_CONCURRENCY)
        self.generator = remote.remote(self.cfg, ray.put(list(self.prompts)), self.engine,
                                       self.reward_handle, worker_env())
        self.policy_version = position.global_step
        self.generator_pid = ray_get(self.generator.start.remote(position.epoch, position.batch_in_epoch,
                                                                 position.global_step, self.policy_version), GENERATOR)

    def close(self) -> None:
        """Stop the generator (its stats kept in `last_generator_stats`) and kill its actor."""
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

    # -- the supply -------------------------------------------------------------------------------------------
    def next_rollout(self, position: LoopState) -> Rollout | None:
        """The oldest queued batch, its data position adopted into `position`; None when the data is used up. The
        generator's own error (e.g. a failing reward function) is raised here."""
        if self.generator is None:
            self._start(position)
        import ray

        started = time.perf_counter()
        try:
            item = ray_get(self.generator.next_batch.remote(), GENERATOR)
        except ray.exceptions.RayTaskError as e:
            cause = unwrap_user_error(e)
            if cause is not e:
                raise cause from None
            raise ComponentFailed(f"{GENERATOR} failed: {type(e.cause).__name__}: {e.cause}") from None
        if item is None:
            return None
        wait_s = time.perf_counter() - started
        position.epoch, position.batch_in_epoch = item["position"]  # only consumed batches count
        return self._rollout_of(item, position.global_step, wait_s)

    def _rollout_of(self, item: dict[str, Any], step: int, wait_s: float) -> Rollout:
        """A queued batch as the Rollout of step `step` + 1 with the async metrics, recorded in `consumed` and
        `trained_prompts`."""
        exp = Experience.from_dict(item["experience"])
        sampled, newest = exp.info["policy_version"], exp.info["policy_version_max"]
        lag = self.policy_version - sampled
        self.consumed.append({
            "step": step + 1, "trainer_version": self.policy_version, "sample_version": int(sampled.min()),
            "sample_version_max": int(newest.max()), "position": tuple(item["position"]),
            "old_log_probs_from_actor_forward": not reuses_old_log_probs(self.cfg, self.has_reference, len(exp),
                                                                         step)})
        self.trained_prompts.extend(item["texts"]["prompts"])
        token_lag = self.policy_version - exp.info.get("policy_version_mean", sampled)
        metrics = {"async/staleness": float(lag.max()), "async/staleness_mean": float(lag.float().mean()),
                   "async/token_staleness_mean": float(token_lag.float().mean()),
                   "async/mixed_version_samples": float((newest > sampled).float().mean()),
                   "async/wait_s": wait_s, "async/queued": float(item["queued_after"])}
        return Rollout(exp, item["texts"], item["reward"], item["recipe_metrics"], dict(item["timings"]),
                       started=time.perf_counter() - wait_s, extra_metrics=metrics)


class LockedWeightSync:
    """`inner` (the Ray weight sync) under the generator's lock: no engine changes weights inside a generate call,
    and each update bumps the policy version the generator stamps on samples. Before the generator starts (the
    first sync, and the one after a resume) it is `inner` alone."""

    def __init__(self, inner: WeightSync, queue: GeneratorQueue):
        self.inner = inner
        self.queue = queue

    def sync(self) -> dict[str, float] | None:
        generator = self.queue.generator
        if generator is None:
            return self.inner.sync()
        ray_get(generator.begin_weight_update.remote(), f"{GENERATOR} (waiting to update weights)")
        try:
            return self.inner.sync()
        finally:
            self.queue.policy_version += 1
            ray_get(generator.end_weight_update.remote(self.queue.policy_version), GENERATOR)
