"""The agent API an agent file (`--agent_func_path`) builds on, in both of OpenRLHF's generations.

An agent file defines `AgentInstance(AgentInstanceBase)` (one episode's environment: async `reset(states)` and
`step(states)`) and `AgentExecutor`, either the form of OpenRLHF's example commands

    class AgentExecutor(AgentExecutorBase):
        def __init__(self, max_steps, max_length, llm_engine, hf_tokenizer, result_queue):
            super().__init__(AgentInstance, max_steps, max_length, llm_engine, hf_tokenizer, result_queue)

or OpenRLHF 0.11's `class AgentExecutor(MultiTurnAgentExecutor)` whose `__init__()` calls
`super().__init__(AgentInstance)`. Either may override `async execute(prompt, label, sampling_params)` and call
super's. `AgentInstance.__init__` may be `async def` (as OpenRLHF's example agent writes it).

`step` returns a dict: `rewards` (number / tensor; the turns' rewards add up to the episode's reward), `scores`
(the last turn's is the episode's, default: the summed rewards), `environment_feedback` (text appended to the
context, tokenised once), `done`, optional `sampling_params` (the next turn's: a dict whose "max_tokens" caps
that turn; temperature / top_p / top_k must stay the run's, which the trainer's log-probs assume) and
`extra_logs` (name -> number; the last turn's values are the episode's), `environment_images` (images shown
with the feedback, for a vision-language policy: `rlhfkit.agents.image_feedback`) and, for the run report's trace
viewer, `tool_calls` (what the turn's tools were asked and answered: [{"name", "arguments", "result", "ok"}]).

Token in, token out (the multi-turn loop of `AgentExecutorBase.execute`): the context is a list of token ids that
only ever grows: the prompt's ids as the trainer tokenised them, each turn's sampled ids exactly as the engine
returned them, the feedback's ids. Sampled tokens carry action mask 1 and their engine log-probs; feedback tokens
mask 0 (no loss, no KL, no value target). The response budget `max_length` (--generate_max_len) covers the whole
episode (actions and feedback); the episode ends at `done`, after `max_steps` turns (--max_steps), or when the
budget is spent (truncated).
"""

from __future__ import annotations

import asyncio
import inspect
import math
from dataclasses import dataclass, field
from typing import Any

FINISH_DONE, FINISH_TURNS, FINISH_BUDGET, FINISH_FAILED = "done", "turns", "budget", "failed"


class AgentFailure(Exception):
    """The agent's own code failed (`kind`: exception or timeout); the episode ends and is counted as failed."""

    def __init__(self, kind: str, text: str):
        super().__init__(text)
        self.kind = kind


class Prompt(str):
    """A prompt text that also carries the token ids the trainer made of it (kept through a user's `execute`
    override, which passes the prompt on as a string)."""

    token_ids: list[int]

    def __new__(cls, text: str, token_ids: list[int]) -> Prompt:
        obj = super().__new__(cls, text)
        obj.token_ids = list(token_ids)
        return obj


@dataclass
class Episode:
    """One finished episode: the token trace (prompt, then actions and feedback) and what it earned."""

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # per response token; 0.0 on feedback tokens
    action_mask: list[int] = field(default_factory=list)  # 1: sampled by the policy, 0: environment feedback
    reward: float = 0.0
    score: float | None = None
    turns: int = 0
    feedback_tokens: int = 0
    finish: str = FINISH_BUDGET
    extra_logs: dict[str, float] = field(default_factory=dict)
    error: str = ""  # why a failed episode failed: "exception: step raised ValueError: ..." / "timeout: ..."
    turn_log: list[dict[str, Any]] = field(default_factory=list)  # per turn: reward, action_tokens, tool_calls

    def log_turn(self, out: dict, reward: float, action_tokens: int) -> None:
        """Note what a finished turn did, for the run report's trace viewer (rlhfkit.agents.trace)."""
        calls = out.get("tool_calls")
        self.turn_log.append({"reward": reward, "action_tokens": action_tokens, "done": bool(out.get("done")),
                              "tool_calls": calls if isinstance(calls, list) else []})

    @property
    def truncated(self) -> bool:
        return self.finish == FINISH_BUDGET


class AgentInstanceBase:
    """One episode's environment. Override `step` (and `reset` to change the first observation)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    async def reset(self, states: dict, **kwargs: Any) -> dict:
        return {"observation": states["observation"]}

    async def step(self, states: dict, **kwargs: Any) -> dict:
        raise NotImplementedError("AgentInstance.step(states) must return rewards, environment_feedback and done")


async def create_instance(cls: Any, *args: Any, **kwargs: Any) -> Any:
    """`cls(*args, **kwargs)`, awaiting an `async def __init__` (calling such a class directly raises TypeError:
    __init__() should return None, not 'coroutine'). `cls` is typed Any: no class type has an async __init__."""
    if inspect.iscoroutinefunction(cls.__init__):
        instance = cls.__new__(cls)
        await cls.__init__(instance, *args, **kwargs)
        return instance
    return cls(*args, **kwargs)


def total(value: Any) -> float:
    """A reward given as a number, a tensor or a list: the sum of its entries."""
    if value is None:
        return 0.0
    if hasattr(value, "detach"):
        return float(value.detach().float().sum())
    if isinstance(value, (list, tuple)):
        return float(sum(total(v) for v in value))
    return float(value)


def step_output(out: Any) -> tuple[dict, float, float | None]:
    """(the dict, its summed rewards, its summed scores or None) of what `step` returned; anything else (not a dict,
    rewards that are no number, NaN / inf) is the agent's failure, costing its episode (kind bad_output or
    non_finite)."""
    out = {} if out is None else out
    if not isinstance(out, dict):
        raise AgentFailure("bad_output", f"step returned {type(out).__name__}, not a dict (rewards, "
                                         "environment_feedback, done)")
    try:
        rewards = total(out.get("rewards"))
        scores = None if out.get("scores") is None else total(out["scores"])
    except (TypeError, ValueError) as e:
        raise AgentFailure("bad_output", f"step returned rewards / scores that are not numbers ({e})") from None
    if not all(math.isfinite(v) for v in (rewards, 0.0 if scores is None else scores)):
        raise AgentFailure("non_finite", f"step returned rewards {rewards} / scores {scores}: not finite")
    return out, rewards, scores


def numbers(logs: Any) -> dict[str, float]:
    out: dict[str, float] = {}
    for key, value in (logs or {}).items():
        try:
            out[str(key)] = total(value)
        except (TypeError, ValueError):
            continue
    return out


class AgentExecutorBase:
    """Runs episodes of `agent_instance_cls` against an LLM engine (see the module docstring).

    `llm_engine` is an object with `async generate(token_ids, max_new_tokens, sampling_params) -> SampledSequence`
    (rlhfkit.agents.episodes.BatchingGenerator inside the rollout engines, which batches concurrent episodes)."""

    def __init__(self, agent_instance_cls: type | None = None, max_steps: int | None = None,
                 max_length: int | None = None, llm_engine: Any = None, hf_tokenizer: Any = None,
                 result_queue: Any = None):
        self.agent_instance_cls = agent_instance_cls
        self.max_steps = max_steps
        self.max_length = max_length
        self.llm_engine = llm_engine
        self.hf_tokenizer = hf_tokenizer
        self.result_queue = result_queue  # OpenRLHF's example signature; episodes are returned, not queued
        self.step_timeout: float | None = None
        self.tool_format: str | None = None

    def bind(self, *, max_steps: int, max_length: int, llm_engine: Any, hf_tokenizer: Any,
             step_timeout: float | None = None, tool_format: str | None = None) -> AgentExecutorBase:
        """What the run provides (OpenRLHF 0.11's executors take no constructor arguments); `tool_format`
        (--tool_format) is read by tool agents (rlhfkit.agents.tool_agent)."""
        self.max_steps, self.max_length = max_steps, max_length
        self.llm_engine, self.hf_tokenizer = llm_engine, hf_tokenizer
        self.step_timeout, self.tool_format = step_timeout, tool_format
        return self

    def _budget(self, max_length: int | None) -> int:
        """The episode's response budget: execute()'s max_length, else the one bound to the executor."""
        budget = max_length or self.max_length
        if budget is None:
            raise TypeError("AgentExecutorBase needs max_length: from the constructor, bind() or execute()")
        return int(budget)

    async def _user(self, what: str, call: Any) -> Any:
        """Await the agent's own code with the run's timeout; its failures become AgentFailure."""
        timeout = getattr(self, "step_timeout", None)
        try:
            return await (asyncio.wait_for(call, timeout) if timeout else call)
        except asyncio.TimeoutError:
            raise AgentFailure("timeout", f"{what} took more than {timeout:g} s") from None
        except AgentFailure:  # already said (an isolated instance's worker failed)
            raise
        except Exception as e:  # noqa: BLE001 - the agent's code: its failure costs this episode
            text = str(e).strip()
            raise AgentFailure("exception", f"{what} raised {type(e).__name__}"
                                            + (f": {text.splitlines()[0]}" if text else "")) from None

    def _prompt_ids(self, text: str, prompt: Any) -> list[int]:
        if isinstance(prompt, Prompt) and text == str(prompt):
            return list(prompt.token_ids)
        from rlhfkit.data.tokens import encode, with_bos

        # A text rendered by a chat template may start with bos already (Llama 3's <|begin_of_text|>, SmolLM2's
        # <|im_start|>): a second one would put the prompt off the template the model was trained on.
        return with_bos(self.hf_tokenizer, encode(self.hf_tokenizer, text))

    async def execute(self, prompt: str, label: Any, sampling_params: Any, max_length: int | None = None,
                      hf_tokenizer: Any = None, llm_engine: Any = None) -> Episode:
        """One episode of the multi-turn loop; returns its token trace and rewards."""
        tokenizer = hf_tokenizer or self.hf_tokenizer
        engine = llm_engine or self.llm_engine
        budget = self._budget(max_length)
        if self.agent_instance_cls is None:
            raise TypeError("AgentExecutorBase needs the AgentInstance class: super().__init__(AgentInstance, ...)")
        episode = Episode(prompt_ids=self._prompt_ids(str(prompt), prompt))
        try:
            return await self._episode(episode, prompt, label, sampling_params, tokenizer, engine, budget)
        except AgentFailure as failure:
            episode.finish, episode.error = FINISH_FAILED, f"{failure.kind}: {failure}"
            return episode

    async def _reset(self, agent: Any, prompt: Any, label: Any) -> str:
        """The episode's first observation: what `reset` returns (a dict), by default the prompt."""
        first = await self._user("reset", agent.reset({"observation": str(prompt), "label": label}))
        if first is not None and not isinstance(first, dict):
            raise AgentFailure("bad_output", f"reset returned {type(first).__name__}, not a dict with an observation")
        return str((first or {}).get("observation", prompt))

    async def _episode(self, episode: Episode, prompt: Any, label: Any, sampling_params: Any, tokenizer: Any,
                       engine: Any, budget: int) -> Episode:
        agent = await self._user("AgentInstance()", create_instance(self.agent_instance_cls))
        observation = await self._reset(agent, prompt, label)
        episode.prompt_ids = self._prompt_ids(observation, prompt)
        context = list(episode.prompt_ids)
        scores: float | None = None
        logs: dict[str, float] = {}
        while True:
            room = budget - len(episode.response_ids)
            if room <= 0:
                episode.finish = FINISH_BUDGET
                break
            turn_cap = sampling_params.get("max_tokens") if isinstance(sampling_params, dict) else None
            sample = await engine.generate(context, min(room, int(turn_cap)) if turn_cap else room, sampling_params)
            action = list(sample.response_ids)
            context += action
            episode.response_ids += action
            episode.logprobs += list(sample.logprobs) + [0.0] * (len(action) - len(sample.logprobs))
            episode.action_mask += [1] * len(action)
            episode.turns += 1
            action_text = tokenizer.decode(action, skip_special_tokens=True)
            out, rewards, turn_scores = step_output(await self._user("step", agent.step(
                {"observation_text": observation, "action_text": action_text, "action_ids": list(action),
                 "label": label, "sampling_params": sampling_params})))
            episode.reward += rewards
            episode.log_turn(out, rewards, len(action))
            if turn_scores is not None:
                scores = turn_scores
            logs.update(numbers(out.get("extra_logs")))
            if out.get("sampling_params") is not None:  # the next turn's (e.g. a "max_tokens" cap per turn)
                sampling_params = out["sampling_params"]
            if out.get("done"):
                episode.finish = FINISH_DONE
                break
            if self.max_steps is not None and episode.turns >= self.max_steps:
                episode.finish = FINISH_TURNS  # the turn budget: no feedback after the last turn
                break
            feedback = str(out.get("environment_feedback") or "")
            observation += action_text + feedback
            feedback_ids, pixels = _feedback_tokens(engine, tokenizer, feedback, out.get("environment_images"))
            if not _add_feedback(episode, context, feedback_ids, budget):
                break
            if pixels is not None:  # the images are in the context now: later turns and the trainer see them
                getattr(engine, "batcher", engine).keep_images(pixels)
        episode.score = scores if scores is not None else episode.reward
        episode.extra_logs = logs
        return episode


def _feedback_tokens(engine: Any, tokenizer: Any, text: str, images: Any) -> tuple[list[int], Any]:
    """(ids, pixels or None) of a turn's feedback; with `environment_images` the engine (the episodes'
    `BatchingGenerator`) marks, tokenises and processes them (`rlhfkit.agents.image_feedback`)."""
    if not images:
        return (tokenizer.encode(text, add_special_tokens=False) if text else []), None
    engine = getattr(engine, "batcher", engine)  # an OpenRLHF-form episode engine wraps the batching generator
    if not hasattr(engine, "image_feedback"):
        raise AgentFailure("bad_output", "step returned environment_images, but this engine takes no images")
    try:
        return engine.image_feedback(tokenizer, text, list(images))
    except Exception as e:  # noqa: BLE001 - a bad image or a text policy: this episode's failure
        raise AgentFailure("bad_output", f"environment_images: {e}") from None


def _add_feedback(episode: Episode, context: list[int], feedback_ids: list[int], budget: int) -> bool:
    """Append a turn's feedback tokens (mask 0) to the context and the episode; False (and the episode ends
    truncated) when no room would be left to act after them."""
    if len(episode.response_ids) + len(feedback_ids) >= budget:
        episode.finish = FINISH_BUDGET
        return False
    context += feedback_ids
    episode.response_ids += feedback_ids
    episode.logprobs += [0.0] * len(feedback_ids)
    episode.action_mask += [0] * len(feedback_ids)
    episode.feedback_tokens += len(feedback_ids)
    return True


class MultiTurnAgentExecutor(AgentExecutorBase):
    """OpenRLHF 0.11's executor: `super().__init__(AgentInstance)`; the run binds the rest."""

    def __init__(self, agent_instance_cls: type):
        super().__init__(agent_instance_cls)
