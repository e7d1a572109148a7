"""OpenRLHF agent files as their authors wrote them: the `openrlhf` import line, and OpenRLHF 0.11's executors that
drive the engine themselves and return a dict.

Imports. An agent file written for OpenRLHF starts with `from openrlhf.utils.agent import ...`. While rlhfkit
imports such a file (in the engine process and in the agent workers), `openrlhf.utils.agent` names
`rlhfkit.agents.api` (`IMPORT_ALIASES`, installed by `rlhfkit.rewards.user_code_worker.aliased_imports`); before
and after, `sys.modules` is as it was, so an installed `openrlhf` package is never shadowed, and nothing of it is
imported for the agent file. Other `openrlhf.*` modules do not exist in that window: a file that imports one stops
with one line.

Executors. OpenRLHF 0.11's `AgentExecutorBase.execute(prompt, label, sampling_params, max_length, hf_tokenizer,
llm_engine)` may be overridden whole: it calls `await llm_engine.generate(token_ids, sampling_params)`, reads
`request_output.outputs[0].token_ids / .text / .logprobs` (vLLM's shapes), and returns a dict with
`observation_tokens` (the whole context: prompt, actions, feedback), `action_ranges` ([start, end) of each action in
it), `rollout_log_probs` (per context token, or None), `reward`, `scores` and `extra_logs`. `OpenRLHFEngine` gives such
an executor that engine on top of the episode batcher (recording what it sampled, so log-probs are known even when
the file asks for none) and `SamplingParams` the attribute access it expects; `episode_from_dict` turns the dict into
the `Episode` the rest of rlhfkit trains on.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

from rlhfkit.agents.api import FINISH_BUDGET, FINISH_DONE, AgentExecutorBase, AgentFailure, Episode, numbers, total

IMPORT_ALIASES = {"openrlhf.utils.agent": "rlhfkit.agents.api"}


class SamplingParams(dict):
    """The sampling parameters as a dict (rlhfkit's agents read `sampling_params.get("max_tokens")`) that also
    answers vLLM's attributes (`sampling_params.max_tokens`, `.logprobs`), None when unset, and takes assignments."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return self.get(name)

    def __setattr__(self, name: str, value: Any) -> None:
        self[name] = value

    def __deepcopy__(self, memo: dict) -> SamplingParams:
        return SamplingParams(self)


@dataclass
class Logprob:
    logprob: float


@dataclass
class CompletionOutput:
    token_ids: list[int]
    text: str
    logprobs: list[dict[int, Logprob]]


@dataclass
class RequestOutput:
    outputs: list[CompletionOutput]


@dataclass
class OpenRLHFEngine:
    """One episode's engine, in both call forms: rlhfkit's `generate(ids, max_new_tokens, sampling_params)` (the
    base executor's) and vLLM's `generate(ids, sampling_params)` with `sampling_params.max_tokens` (OpenRLHF 0.11's
    executors), which returns a vLLM-shaped `RequestOutput`. Records each vLLM-form sample's start and log-probs."""

    batcher: Any  # rlhfkit.agents.episodes.BatchingGenerator
    tokenizer: Any
    default_max_tokens: int
    sampled: dict[int, list[float]] = field(default_factory=dict)  # context length at the call -> log-probs

    async def generate(self, token_ids: Any, max_new_tokens: Any = None, sampling_params: Any = None) -> Any:
        if isinstance(max_new_tokens, int):
            return await self.batcher.generate(token_ids, max_new_tokens, sampling_params)
        params = max_new_tokens if max_new_tokens is not None else sampling_params  # vLLM's form
        ids = [int(t) for t in token_ids]
        cap = getattr(params, "max_tokens", None) or self.default_max_tokens
        sample = await self.batcher.generate(ids, int(cap), dict(params) if isinstance(params, dict) else None)
        response = list(sample.response_ids)
        logprobs = list(sample.logprobs) + [0.0] * (len(response) - len(sample.logprobs))
        self.sampled[len(ids)] = logprobs
        text = self.tokenizer.decode(response, skip_special_tokens=True)
        return RequestOutput([CompletionOutput(response, text, [{t: Logprob(p)} for t, p in zip(response, logprobs)])])


def takes_engine(executor: Any) -> bool:
    """Whether the file overrides `execute` in OpenRLHF 0.11's form, with six arguments (OpenRLHF's example
    commands override it with three; rlhfkit's own `execute` is called with three as well)."""
    if type(executor).execute is AgentExecutorBase.execute:
        return False
    params = inspect.signature(executor.execute).parameters.values()
    return any(p.kind == p.VAR_POSITIONAL for p in params) or len(params) >= 6 or any(
        p.name == "llm_engine" for p in params)


def _ranges(value: Any, length: int) -> list[tuple[int, int]]:
    ranges = [(int(a), int(b)) for a, b in value]
    end = 0
    for a, b in ranges:
        if not end <= a <= b <= length:
            raise AgentFailure("bad_output", f"execute returned action_ranges {ranges} that are not ordered, "
                                             f"disjoint spans within its {length} observation_tokens")
        end = b
    if not ranges:
        raise AgentFailure("bad_output", "execute returned no action_ranges: the episode sampled nothing to train")
    return ranges


def episode_from_dict(out: Any, engine: OpenRLHFEngine, budget: int) -> Episode:
    """The `Episode` of an OpenRLHF 0.11 `execute()` dict (see the module docstring); a malformed dict is the
    agent's failure (`AgentFailure`, kind bad_output), costing this episode only."""
    if not isinstance(out, dict) or "observation_tokens" not in out or "action_ranges" not in out:
        raise AgentFailure("bad_output", f"execute returned {type(out).__name__}, not an Episode or OpenRLHF's dict "
                                         "with observation_tokens and action_ranges")
    try:
        tokens = [int(t) for t in out["observation_tokens"]]
        ranges = _ranges(out["action_ranges"], len(tokens))
    except (TypeError, ValueError) as e:
        raise AgentFailure("bad_output", f"execute returned unreadable observation_tokens / action_ranges ({e})") \
            from None
    start = ranges[0][0]
    mask = [0] * (len(tokens) - start)
    logprobs = [0.0] * (len(tokens) - start)
    given = out.get("rollout_log_probs")
    for a, b in ranges:
        mask[a - start:b - start] = [1] * (b - a)
        if given is not None and len(given) == len(tokens):
            logprobs[a - start:b - start] = [float(x) for x in given[a:b]]
        elif a in engine.sampled:  # the engine knows what it sampled there
            logprobs[a - start:b - start] = engine.sampled[a][:b - a]
    reward = total(out.get("reward"))
    score = out.get("scores")
    episode = Episode(prompt_ids=tokens[:start], response_ids=tokens[start:], logprobs=logprobs, action_mask=mask,
                      reward=reward, score=total(score) if score is not None else reward, turns=len(ranges),
                      feedback_tokens=mask.count(0), extra_logs=numbers(out.get("extra_logs")))
    episode.finish = FINISH_BUDGET if len(episode.response_ids) >= budget else FINISH_DONE
    return episode
