"""The generator of asynchronous RL (`--async_train`): a Ray actor that generates and scores rollout batches into a
bounded queue while the trainer trains on the previous ones.

The generator owns a complete `RolloutSource` (`rlhfkit.rl.rollout_source`: prompts from the seeded stream, engine
generation or agent episodes, reward scoring, dynamic filtering), the same one a synchronous run drives, over the
engine seen through `VersionedEngine`. The driver's side (`rlhfkit.rl.async_driver.GeneratorQueue`) hands each
batch to the trainer, which finishes it (reference / critic / actor forwards, advantages) and trains on it.

Invariants, checked by tests/distributed/test_ray_async.py (chunked generation by tests/rl/test_async_generator.py):
- Staleness: the queue holds `--async_queue_size` *slots*; a slot is taken before a batch's prompts are drawn and
  given back when the trainer takes the batch. With one weight update per trained batch, a consumed sample is at
  most `--async_queue_size` policy versions behind the trainer.
- One lock orders generation and weight updates: every engine generate call holds it (`generating`), a weight
  update holds it from `begin_weight_update` to `end_weight_update`, so an engine never changes weights inside a
  generate call. A pending update blocks the next generate call from taking the lock (no starvation). With
  `--partial_rollout` generation runs in chunks of `--partial_rollout_chunk_len` tokens, each its own generate
  call, so an update lands between chunks instead of waiting for the whole batch; every token records the version
  that sampled it (`SampledSequence.versions`).
- Failure: an exception in the generator thread is kept and raised by the trainer's next `next_batch` call (the
  lock is released on the way out, so a trainer waiting to update weights is not stuck); a dead generator actor is
  reported by `ray_get` as ComponentFailed naming it.
- Data position: each queued batch carries the stream position after its prompts; the trainer adopts it when it
  takes the batch, so a checkpoint counts only consumed batches and a resume regenerates whatever was queued.
"""

from __future__ import annotations

import collections
import contextlib
import os
import threading
import time
import traceback
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from rlhfkit.config.rl import PPOConfig
from rlhfkit.rollout.engine import FINISH_LENGTH, FINISH_STOP, SampledSequence


class VersionedEngine:
    """The rollout engine as the generator sees it: every call under the generator's lock, every token stamped
    with the policy version that sampled it; with --partial_rollout, generation in chunks of tokens."""

    def __init__(self, engine: Any, generator: RolloutGenerator, chunk_len: int | None):
        self.engine = engine
        self.generator = generator
        self.chunk_len = chunk_len  # None: one generate call per batch

    def generate(self, prompt_ids: Sequence[Sequence[int]], *, max_new_tokens: int, seed: int | None = None,
                 **sampling: Any) -> list[SampledSequence]:
        if self.chunk_len is None:
            with self.generator.generating() as version:
                samples = self.engine.generate(prompt_ids, max_new_tokens=max_new_tokens, seed=seed, **sampling)
            for s in samples:
                s.versions = [version] * len(s.response_ids)
            return samples
        out = [SampledSequence(list(p), [], [], FINISH_LENGTH, versions=[]) for p in prompt_ids]
        active, round_ = list(range(len(out))), 0
        while active:
            budget = min(self.chunk_len, max_new_tokens - len(out[active[0]].response_ids))
            contexts = [out[i].prompt_ids + out[i].response_ids for i in active]
            with self.generator.generating() as version:  # a pending weight update lands between chunks
                got = self.engine.generate(contexts, max_new_tokens=budget,
                                           seed=None if seed is None else seed + 7919 * round_, **sampling)
            self.generator.episode_versions.append(version)
            still = []
            for i, s in zip(active, got):
                o = out[i]
                o.response_ids += s.response_ids
                o.logprobs += s.logprobs
                o.versions += [version] * len(s.response_ids)  # type: ignore[operator]
                if s.finish_reason == FINISH_STOP:
                    o.finish_reason = FINISH_STOP
                elif len(o.response_ids) < max_new_tokens:
                    still.append(i)
            active, round_ = still, round_ + 1
        return out

    def generate_episodes(self, requests: Sequence[dict[str, Any]], agent_path: str, **kwargs: Any) -> list[dict]:
        """Agent episodes. Without --partial_rollout they run inside the engines, the whole batch one locked call
        of one version. With it they run here, in the generator: every engine call of an episode goes through
        `generate` (locked, chunked, versioned), so a weight update lands between turns and between the chunks of
        a turn, the episode continues with the new weights, and each token records the version that sampled it
        (rlhfkit.agents.episode_versions)."""
        if self.chunk_len is None:
            with self.generator.generating() as version:
                episodes = self.engine.generate_episodes(requests, agent_path, **kwargs)
            self.generator.episode_versions.append(version)
            return episodes
        from rlhfkit.agents.episodes import run_episodes

        first_call = len(self.generator.episode_versions)
        episodes = run_episodes(self.generate, self.generator.source.tokenizer, agent_path, requests, **kwargs)
        oldest = min(self.generator.episode_versions[first_call:], default=self.generator.version)
        for e in episodes:
            if e["versions"] is None:  # its calls came from outside its task (an OpenAI endpoint's server thread)
                e["versions"] = [oldest] * len(e["response_ids"])
        return episodes

    def sleep(self) -> None:
        """Engines stay awake in async mode (validated: no --vllm_enable_sleep)."""

    def wake(self) -> None:
        """See `sleep`."""


class RolloutGenerator:
    """The generator actor's body (`ray.remote(RolloutGenerator).options(max_concurrency=...)`): a producer thread
    plus the trainer's calls `next_batch`, `begin_weight_update` / `end_weight_update`, `stop`."""

    def __init__(self, cfg: PPOConfig, prompts: Sequence[dict], engine: Any, reward: Any,
                 env: dict[str, str] | None = None):
        os.environ.update(env or {})
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        # imported once the worker's environment is set (thread counts, timeouts)
        from rlhfkit.distributed.ray_groups import set_call_timeout
        from rlhfkit.models.loading import load_tokenizer_for
        from rlhfkit.rl.rollout_source import RolloutSource
        from rlhfkit.run.loop import LoopState
        from rlhfkit.run.setup import make_text_reward

        set_call_timeout(cfg.resources.ray_call_timeout)
        self.cfg = cfg
        a = cfg.asynchronous
        self.text_reward = make_text_reward(cfg) if reward is None else None  # its worker pool lives here
        self.engine = VersionedEngine(engine, self, a.partial_rollout_chunk_len if a.partial_rollout else None)
        self.source = RolloutSource(cfg, self.engine, reward if reward is not None else self.text_reward,
                                    load_tokenizer_for(cfg.model), prompts)
        self.position = LoopState()  # the stream position of the next batch drawn, and its step (sampling seed)
        self.batches_per_call = (a.vllm_generate_batch_size or cfg.rollout.rollout_batch_size) \
            // cfg.rollout.rollout_batch_size
        self.lock = threading.Lock()
        self.update_pending = threading.Event()
        self.version = 0
        self.slots = threading.Semaphore(a.async_queue_size)
        self.ready: collections.deque[dict[str, Any]] = collections.deque()
        self.changed = threading.Condition()
        self.error: BaseException | None = None
        self.done = False
        self.stopping = threading.Event()
        self.episode_versions: list[int] = []
        self.intervals: dict[str, list[tuple[float, float]]] = {"generate": [], "update": []}
        self._update_started = 0.0
        self.thread: threading.Thread | None = None

    # -- the lock ---------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def generating(self) -> Iterator[int]:
        """Hold the lock for one engine call and yield the policy version it samples with."""
        while self.update_pending.is_set() and not self.stopping.is_set():
            time.sleep(0.005)  # a weight update is waiting for the lock: let it in first
        with self.lock:
            started = time.monotonic()
            try:
                yield self.version
            finally:
                self.intervals["generate"].append((started, time.monotonic()))

    def begin_weight_update(self) -> None:
        """Trainer: wait until no generate call runs, then hold the lock until `end_weight_update`."""
        self.update_pending.set()
        self.lock.acquire()
        self._update_started = time.monotonic()

    def end_weight_update(self, version: int) -> None:
        """Trainer: the engines hold policy `version` now; generation may go on."""
        self.version = version
        self.intervals["update"].append((self._update_started, time.monotonic()))
        self.update_pending.clear()
        self.lock.release()

    # -- producing --------------------------------------------------------------------------------------------
    def start(self, episode: int, batch_in_episode: int, step: int, version: int) -> int:
        """Begin producing from the stream position (episode, batch_in_episode); returns this process's pid."""
        p = self.position
        p.global_step, p.epoch, p.batch_in_epoch = step, episode, batch_in_episode
        self.version = version
        self.thread = threading.Thread(target=self._produce, name="rollout-generator", daemon=True)
        self.thread.start()
        return os.getpid()

    def _take_slot(self) -> bool:
        while not self.stopping.is_set():
            if self.slots.acquire(timeout=0.2):
                return True
        return False

    def _produce(self) -> None:
        try:
            while not self.stopping.is_set():
                batches = self._produce_call()
                if not batches:
                    break
                with self.changed:
                    self.ready.extend(batches)
                    self.changed.notify_all()
        except BaseException as e:  # noqa: BLE001 - handed to the trainer, which stops the run with it
            traceback.print_exc()
            self.error = e
        finally:
            with self.changed:
                self.done = True
                self.changed.notify_all()

    def _produce_call(self) -> list[dict[str, Any]]:
        """One engine call's worth of batches (--vllm_generate_batch_size / --rollout_batch_size of them, each
        holding its own queue slot), or [] when the data is used up."""
        position = self.position
        parts: list[tuple[list[int], tuple[int, int], int]] = []
        for _ in range(self.batches_per_call):
            if not self._take_slot():
                break
            indices = self.source.next_prompts(position)
            if indices is None:
                self.slots.release()
                break
            parts.append((list(indices), (position.epoch, position.batch_in_epoch), position.global_step))
            position.global_step += 1
        if not parts:
            return []
        position.global_step = parts[0][2]  # the sampling seed of the call is its first step's, as in sync training
        self.episode_versions.clear()
        rollout = self.source.rollout([i for p in parts for i in p[0]], position)
        position.global_step = parts[-1][2] + 1
        exp, texts, reward = rollout.experience, rollout.texts, rollout.reward
        if len(parts) == 1:  # --dynamic_filtering may have drawn more prompts to refill the batch
            parts[0] = (parts[0][0], (position.epoch, position.batch_in_epoch), parts[0][2])
        if "policy_version" not in exp.info:  # agent episodes: the oldest version of the batch's engine calls
            oldest = float(min(self.episode_versions, default=self.version))
            exp.info["policy_version"] = torch.full((len(exp),), oldest)
            exp.info["policy_version_max"] = torch.full((len(exp),), float(max(self.episode_versions,
                                                                              default=self.version)))
        rows = len(exp) // len(parts)
        batches = []
        for k, (_, at, step) in enumerate(parts):
            sl = slice(k * rows, (k + 1) * rows)
            batches.append({
                "experience": exp.select(sl).to_dict() if len(parts) > 1 else exp.to_dict(),
                "texts": {key: v[sl] if isinstance(v, list) else v for key, v in texts.items()},
                "reward": {**reward, "rewards": reward["rewards"][sl], "scores": reward["scores"][sl]},
                "recipe_metrics": rollout.recipe_metrics, "timings": dict(rollout.timings), "position": at,
                "step": step})
        return batches

    # -- the trainer's side of the queue ----------------------------------------------------------------------
    def next_batch(self) -> dict[str, Any] | None:
        """The oldest queued batch (waits for one), None when the data is used up; raises the generator's error."""
        with self.changed:
            while not self.ready and self.error is None and not self.done:
                self.changed.wait(0.5)
            if self.ready:
                item = self.ready.popleft()
                self.slots.release()
                item["queued_after"] = len(self.ready)
                return item
        if self.error is not None:
            raise self.error
        return None

    def stats(self) -> dict[str, Any]:
        """Lock intervals (monotonic seconds) of generate calls and weight updates, for tests and benchmarks."""
        return {"intervals": {k: list(v) for k, v in self.intervals.items()}, "version": self.version,
                "pid": os.getpid()}

    def stop(self) -> None:
        self.stopping.set()
        if self.thread is not None:
            self.thread.join(timeout=30)
        close = getattr(self.text_reward, "close", None)  # a reward function's worker pool
        if close is not None:
            close()

