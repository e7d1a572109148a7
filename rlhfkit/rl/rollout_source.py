"""The rollout source: the first arrows of an RL step (docs/architecture.md, "One RL step through the folders").

    prompt stream: --num_episodes passes over the prompts, each in a seeded order of --rollout_batch_size batches
    -> rollout engine: samples with per-token rollout log-probs, or agent episodes
    -> scoring with the reward source
    -> DAPO's dynamic filtering: drop groups outside the score range, refill from the next prompts of the stream
    = one `Rollout` (experience, texts, rewards, timings)

The position in the stream is a `rlhfkit.run.loop.LoopState` (episode = its `epoch`, `batch_in_epoch`,
`global_step` for the sampling seed): the loop's own in a synchronous run, which checkpoints save; the generator
actor's in an asynchronous one. A synchronous run's `RolloutSource` is its batch supply (`next_rollout`); an
asynchronous run builds one, complete, inside the generator actor (`rlhfkit.rl.async_generator`), and the driver
keeps its own for evaluation. The trainer (`rlhfkit.rl.trainer`) finishes what comes out of here.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from rlhfkit.agents.episodes import episodes_to_samples
from rlhfkit.agents.trace import episode_traces, trace_fields
from rlhfkit.config.rl import PPOConfig
from rlhfkit.data.images import expand_image_tokens
from rlhfkit.data.tokens import encode, with_bos
from rlhfkit.errors import UserError
from rlhfkit.rl.experience import Experience, experience_from_samples
from rlhfkit.rl.shaping import fill_filtered_batch
from rlhfkit.rollout.engine import SampledSequence
from rlhfkit.run.loop import LoopState

REPORT_ROLLOUTS_PER_STEP = 4  # rollouts of a step shown in the run report
SEED_STRIDE = 1_000_003  # step k of a run samples with seed * SEED_STRIDE + k
ROUND_STRIDE = 1_000_000_007  # refill round j of --dynamic_filtering adds j * ROUND_STRIDE to the step's seed


@dataclass
class Rollout:
    """One generated and scored batch: what the trainer finishes into a training batch. `reward` holds
    rewards [B], scores [B], extra_logs and metrics (e.g. a reward function's failures); `recipe_metrics` the
    dynamic-filtering numbers; `timings` time/generate_s and time/score_s; `started` the perf_counter at which the
    step's work began (for time/step_s); `extra_metrics` what the batch supply adds (async staleness)."""

    experience: Experience
    texts: dict[str, Any]
    reward: dict[str, Any]
    recipe_metrics: dict[str, float] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    started: float = 0.0
    extra_metrics: dict[str, float] = field(default_factory=dict)

    def report_rows(self, tokenizer: Any = None) -> list[dict[str, Any]]:
        """The first few (prompt, response, reward) of the batch, for the run report; with `tokenizer`, an agent
        episode's row carries its trace for the report's trace viewer (rlhfkit.agents.trace), decoded here, for
        these few rows only."""
        rows: list[dict[str, Any]] = []
        texts = self.texts
        versions = texts.get("policy_versions")
        for i, (prompt, query, reward) in enumerate(zip(texts["prompts"], texts["queries"],
                                                        self.reward["rewards"].tolist())):
            rows.append({"prompt": prompt, "response": query[len(prompt):], "reward": reward})
            if versions is not None:  # async: the policy version that sampled each response token
                rows[-1]["policy_versions"] = versions[i]
            if len(rows) == REPORT_ROLLOUTS_PER_STEP:
                break
        episodes = texts.get("episodes") or []
        if tokenizer is not None and len(episodes) >= len(rows):
            for row, trace in zip(rows, episode_traces(episodes, tokenizer, [r["reward"] for r in rows])):
                row["trace"] = trace
        return rows


def expand_prompt_images(ids: list[int], sample: dict[str, Any], prompt_max_len: int, index: int) -> list[int]:
    """An image prompt's ids with each image-pad token repeated per vision token of its image (`image_grid_thw`
    patches over merge size squared; `sample` a PromptDataset sample with "images" and "vision_tokens"). A prompt
    that --prompt_max_len would cut is refused: the cut would split an image's vision tokens or drop an image whose
    pixels the sample still holds."""
    tokens = sample["vision_tokens"]
    counts = [int(n) for n in sample["images"]["image_grid_thw"].prod(-1) // tokens.merge_size ** 2]
    out = expand_image_tokens(ids, [0] * len(ids), counts, tokens.image_token_id, f"prompt {index}")[0]
    if len(out) > prompt_max_len:
        raise UserError(f"prompt {index}: {len(out)} tokens with its vision tokens, more than --prompt_max_len "
                        f"{prompt_max_len} (an image prompt is never cut); raise --prompt_max_len")
    return out


class SamplingEngine(Protocol):
    """What the rollout source needs from an engine (`rlhfkit.rollout.engine.RolloutEngine`, a Ray engine group, or
    the async generator's `VersionedEngine`): generation, agent episodes (--agent_func_path), sleep / wake."""

    def generate(self, prompt_ids: Sequence[Sequence[int]], *, max_new_tokens: int, temperature: float = 1.0,
                 top_p: float = 1.0, top_k: int = -1, seed: int | None = None) -> list[SampledSequence]: ...

    def generate_episodes(self, requests: Sequence[dict[str, Any]], agent_path: str,
                          **kwargs: Any) -> list[dict[str, Any]]: ...

    def sleep(self) -> None: ...

    def wake(self) -> None: ...


class RolloutSource:
    """Prompts -> generated, scored and filtered rollouts. `engine` is a rollout engine (local, a Ray engine group,
    or the async generator's locked view of one); `reward` scores texts (a reward function, HTTP reward servers, a
    reward-model role or group) or is None when agent episodes bring their rewards."""

    def __init__(self, cfg: PPOConfig, engine: SamplingEngine, reward: Any, tokenizer: Any, prompts: Sequence[dict]):
        self.cfg = cfg
        self.engine = engine
        self.reward = reward
        self.tokenizer = tokenizer
        self.prompts = prompts
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self._prompt_ids: dict[tuple[int, int], list[int]] = {}

    # -- the prompt stream -------------------------------------------------------------------------------------
    def steps_per_episode(self) -> int:
        return len(self.prompts) // self.cfg.rollout.rollout_batch_size

    def next_prompts(self, position: LoopState) -> list[int] | None:
        """The next batch of prompt indices of the stream, advancing `position`; None when every episode is used
        up."""
        r = self.cfg.rollout
        return position.next_batch(len(self.prompts), r.rollout_batch_size, self.cfg.strategy.seed, r.num_episodes)

    # -- the batch supply of a synchronous run --------------------------------------------------------------
    def next_rollout(self, position: LoopState) -> Rollout | None:
        """The rollout of the step after `position.global_step` finished ones, from the next prompts of the
        stream; None when the data is used up."""
        started = time.perf_counter()
        indices = self.next_prompts(position)
        if indices is None:
            return None
        rollout = self.rollout(indices, position)
        rollout.started = started
        return rollout

    def close(self) -> None:
        """Nothing to stop: the engine and the reward source belong to the run, which closes them."""

    # -- one rollout -------------------------------------------------------------------------------------------
    def rollout(self, indices: Sequence[int], position: LoopState) -> Rollout:
        """Generate and score the prompts `indices` with the sampling seed of step `position.global_step`; with
        --dynamic_filtering, drop the groups whose mean score is outside the range and generate from the next
        prompts of the stream (advancing `position`) until rollout_batch_size groups are kept (at most
        --dynamic_filtering_max_rounds rounds)."""
        timings: dict[str, float] = {}
        seed = self.cfg.strategy.seed * SEED_STRIDE + position.global_step
        exp, texts, reward = self._generate_and_score(indices, seed, timings)
        if not self.cfg.recipe.dynamic_filtering:
            return Rollout(exp, texts, reward, {}, timings)

        def generate(round_: int) -> tuple[Experience, dict[str, Any], dict[str, Any]] | None:
            more = self.next_prompts(position)
            return None if more is None else self._generate_and_score(more, seed + round_ * ROUND_STRIDE, timings)

        exp, texts, reward, recipe_metrics = fill_filtered_batch(self.cfg, exp, texts, reward, generate)
        return Rollout(exp, texts, reward, recipe_metrics, timings)

    def _generate_and_score(self, indices: Sequence[int], seed: int, timings: dict[str, float]
                            ) -> tuple[Experience, dict[str, Any], dict[str, Any]]:
        r = self.cfg.rollout
        started = time.perf_counter()
        exp, texts = self.sample(self.prompts, indices, r.n_samples_per_prompt, r.temperature, seed=seed)
        timings["time/generate_s"] = timings.get("time/generate_s", 0.0) + time.perf_counter() - started
        started = time.perf_counter()
        reward = self.score(exp, texts)
        timings["time/score_s"] = timings.get("time/score_s", 0.0) + time.perf_counter() - started
        return exp, texts, reward

    # -- the pieces --------------------------------------------------------------------------------------------
    def prompt_ids(self, dataset: Sequence[dict], index: int, key: int = 0) -> list[int]:
        """Token ids of a prompt: bos + prompt text, left-truncated to --prompt_max_len (cached per dataset
        `key`); an image prompt's image-pad tokens repeated once per vision token of their image first."""
        cached = self._prompt_ids.get((key, index))
        if cached is None:
            ids = with_bos(self.tokenizer, encode(self.tokenizer, dataset[index]["prompt"]))
            if dataset[index].get("images") is not None:
                ids = expand_prompt_images(ids, dataset[index], self.cfg.data.prompt_max_len, index)
            cached = ids[-self.cfg.data.prompt_max_len:]
            self._prompt_ids[(key, index)] = cached
        return cached

    def sample(self, dataset: Sequence[dict], indices: Sequence[int], n: int, temperature: float, seed: int,
               key: int = 0) -> tuple[Experience, dict[str, Any]]:
        """Generate n responses per prompt (adjacent) and pad them into an Experience plus the texts."""
        ids, prompts, labels, images, refs = [], [], [], [], []
        for i in indices:
            record = dataset[i]
            for _ in range(n):
                ids.append(self.prompt_ids(dataset, i, key))
                prompts.append(record["prompt"])
                labels.append(record.get("label"))
                images.append(record.get("images"))
                refs.append(record.get("image_refs") or [])
        row_images = images if any(r is not None for r in images) else None
        self.engine.wake()
        samples, episode_reward, episodes = self._generate(ids, prompts, labels, temperature, seed, row_images)
        self.engine.sleep()
        # agent episodes: each sample brings its context's images (prompt and feedback ones)
        experience = experience_from_samples(samples, self.pad_id, None if episodes else row_images)
        responses = self.tokenizer.batch_decode([s.response_ids for s in samples], skip_special_tokens=False)
        queries = [p + resp for p, resp in zip(prompts, responses)]
        texts: dict[str, Any] = {"queries": queries, "prompts": prompts, "labels": labels}
        if row_images is not None:  # the prompts' image references, for reward functions (rewards/sources.py)
            texts["image_refs"] = refs
        if episode_reward is not None:
            texts["episode_reward"] = episode_reward
        if episodes:  # what the report's trace viewer needs of each, filtered with the texts (dynamic filtering)
            texts["episodes"] = episodes
        if all(s.versions is not None for s in samples):  # async: the policy version of each response token
            texts["policy_versions"] = [list(s.versions or []) for s in samples]
        return experience, texts

    def _generate(self, ids: list[list[int]], prompts: list[str], labels: list[Any], temperature: float,
                  seed: int, images: list[Any] | None = None
                  ) -> tuple[list[Any], dict[str, Any] | None, list[dict[str, Any]]]:
        """(samples, the agent episodes' reward dict or None, the episodes' fields a trace needs): plain
        generation (with the prompts' `images`, one entry per prompt, if any), or with --agent_func_path multi-turn
        episodes run inside the engine(s), whose step rewards are the reward."""
        r, agent = self.cfg.rollout, self.cfg.agent.agent_func_path
        top_p, top_k = (r.top_p, r.top_k) if temperature > 0 else (1.0, -1)
        if not agent:
            with_images = {"images": images} if images is not None else {}  # text-only engines never see the kwarg
            return self.engine.generate(ids, max_new_tokens=self.cfg.data.generate_max_len, temperature=temperature,
                                        top_p=top_p, top_k=top_k, seed=seed, **with_images), None, []
        requests = [{"prompt": p, "prompt_ids": i, "label": lab} for p, i, lab in zip(prompts, ids, labels)]
        reader = getattr(self.prompts, "images", None)  # image prompts / image feedback: the run's image reader
        if reader is not None:
            for request, row in zip(requests, images or [None] * len(requests)):
                request["images"] = row
        code = self.cfg.user_code
        episodes = self.engine.generate_episodes(requests, agent, max_steps=self.cfg.agent.max_steps,
                                                 max_length=self.cfg.data.generate_max_len,
                                                 step_timeout=code.reward_timeout,
                                                 agent_workers=code.reward_workers,
                                                 tool_format=self.cfg.agent.tool_format, temperature=temperature,
                                                 top_p=top_p, top_k=top_k, seed=seed,
                                                 **({"image_reader": reader} if reader is not None else {}))
        samples, reward = episodes_to_samples(episodes, code.reward_fallback, code.max_reward_failure_ratio,
                                              f"agent {agent}", prompts)
        return samples, reward, [trace_fields(e) for e in episodes]

    def score(self, experience: Experience, texts: dict[str, Any]) -> dict[str, Any]:
        """{"rewards": [B], "scores": [B], "extra_logs", "metrics"} from the agent episodes or the reward source."""
        out = texts.get("episode_reward") or self.reward.score({**experience.to_dict(), **texts})
        return {"rewards": torch.as_tensor(out["rewards"]).float().reshape(-1),
                "scores": torch.as_tensor(out.get("scores", out["rewards"])).float().reshape(-1),
                "extra_logs": dict(out.get("extra_logs") or {}),
                "metrics": dict(out.get("metrics") or {})}  # e.g. reward/failures of a reward function file
