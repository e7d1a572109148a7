"""A gym-style environment for agent episodes: `reset(prompt, label) -> observation`, `step(action) -> (observation,
reward, done, info)`.

An environment file (`--agent_func_path env.py`) defines one `Environment` subclass at its top level:

    class GuessTheNumber(Environment):
        def reset(self, prompt, label):
            self.secret = int(label)
            return prompt                        # the first observation
        def step(self, action):                  # action.text: the model's turn
            guess = int(action.text)
            if guess == self.secret:
                return "", 1.0, True, {}
            return "Higher.\\n" if guess < self.secret else "Lower.\\n", 0.0, False, {}

`Action` is what the model did in its turn: its text, the tool calls parsed from it (when the environment declares
`tools`) and one line per malformed call. `step` returns a `Step` or the 4-tuple; `info` holds numbers (logged
as the episode's `extra_logs`, the last turn's values winning). The turns' rewards add up to the episode's reward.

Two modes, by what the environment declares:
- text: no `tools`, and `reset` returns a string. Observations are text appended to the context as they are
  (`reset`'s is the prompt text), like an `AgentInstance`'s `environment_feedback`.
- chat: `tools` declared, or `reset` returns a list of messages. The conversation is rendered through the
  tokenizer's chat template with the tools' schemas; `reset`'s string is the user message; a later string
  observation is a user message, a list holds messages (`tool` results, `user` turns).
`call_tools(action)` runs the action's tool calls with the declared functions and returns the `tool` messages: an
unknown tool, arguments that do not fit the schema or a function that raises cost that call (the model reads
`error: ...`), never the episode.

The environment runs in the user-code worker pool (rlhfkit.agents.env_agent): a `reset`/`step` that raises, hangs
past `--reward_timeout` or crashes its worker costs its episode; one that returns the wrong types too (`check_reset`,
`check_step`: kind `bad_output`, or `non_finite` for a NaN / inf reward), counted under --max_reward_failure_ratio.
"""

from __future__ import annotations

import json
import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rlhfkit.agents.api import AgentFailure
from rlhfkit.agents.tool_parsers import ToolCall
from rlhfkit.agents.tools import Tool, argument_errors, as_tools

Observation = str | list[dict[str, Any]]
ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass
class Action:
    """The model's turn: its text (special tokens left out), the text outside tool calls, the well-formed calls, and
    one line per malformed or cut-off call (chat mode with tools only; otherwise the calls are empty)."""

    text: str
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    call_errors: list[str] = field(default_factory=list)


@dataclass
class Step:
    """What `step` returns (a 4-tuple in this order is taken too)."""

    observation: Observation = ""
    reward: float = 0.0
    done: bool = False
    info: dict[str, float] = field(default_factory=dict)


class Environment:
    """One episode's environment. Override `step` (and `reset`); set `tools` (typed functions, or `Tool`s from
    `tool_from_schema`) for a tool-calling environment, `system_prompt` for a system message in chat mode."""

    tools: Sequence[Any] = ()
    system_prompt: str | None = None

    def reset(self, prompt: str, label: Any) -> Observation:
        return prompt

    def step(self, action: Action) -> Step | tuple[Observation, float, bool, dict[str, float]]:
        raise NotImplementedError("Environment.step(action) must return (observation, reward, done, info)")

    def call_tools(self, action: Action) -> list[dict[str, Any]]:
        """The `tool` messages answering the action's calls, in order: results, or `error: ...` lines."""
        by_name = {t.name: t for t in as_tools(type(self).tools)}
        out = [{"role": "tool", "name": "error", "content": f"error: {e}"} for e in action.call_errors]
        for call in action.tool_calls:
            out.append({"role": "tool", "name": call.name, "content": run_call(by_name, call)})
        return out


def run_call(by_name: dict[str, Tool], call: ToolCall) -> str:
    """One call's result as text, or why it failed (an `error: ...` line the model reads)."""
    tool = by_name.get(call.name)
    if tool is None:
        return f"error: unknown tool {call.name!r} (tools: {', '.join(by_name)})"
    problem = argument_errors(tool, call.arguments)
    if problem:
        return f"error: {problem}"
    try:
        value = tool.function(**call.arguments)
    except Exception as e:  # noqa: BLE001 - the tool's failure is the model's feedback, not the episode's end
        return f"error: tool {tool.name} raised {type(e).__name__}: {str(e).strip()[:300]}"
    return value if isinstance(value, str) else json.dumps(value, default=str)


def _messages(value: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise AgentFailure("bad_output", f"{where} is {type(value).__name__}, not a string or a non-empty list of "
                                         "messages")
    for m in value:
        if not (isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)):
            raise AgentFailure("bad_output", f"{where} holds {str(m)[:80]!r}, not a message {{\"role\": one of "
                                             f"{', '.join(ROLES)}, \"content\": a string}}")
    return [dict(m) for m in value]


def check_observation(value: Any, where: str) -> Observation:
    """A string or a list of chat messages; anything else is the environment's failure (bad_output)."""
    return value if isinstance(value, str) else _messages(value, where)


def check_reset(value: Any) -> Observation:
    return check_observation(value, "reset's observation")


def check_step(value: Any) -> Step:
    """What `step` returned as a Step, its types checked; the environment's failure (AgentFailure) otherwise."""
    if isinstance(value, Step):
        parts: Sequence[Any] = (value.observation, value.reward, value.done, value.info)
    elif isinstance(value, tuple) and len(value) == 4:
        parts = value
    else:
        raise AgentFailure("bad_output", f"step returned {type(value).__name__}, not a Step or a tuple (observation, "
                                         "reward, done, info)")
    observation, reward, done, info = parts
    if _is_bool(reward) or not isinstance(reward, numbers.Real):  # numpy scalars are Real too
        raise AgentFailure("bad_output", f"step's reward is {type(reward).__name__}, not a number")
    if not math.isfinite(reward):
        raise AgentFailure("non_finite", f"step's reward is {reward}: not finite")
    if not _is_bool(done):
        raise AgentFailure("bad_output", f"step's done is {type(done).__name__}, not a bool")
    info = {} if info is None else info
    if not isinstance(info, dict) or not all(isinstance(v, numbers.Real) for v in info.values()):
        raise AgentFailure("bad_output", "step's info is not a dict of numbers")
    checked = "" if done and observation in ("", None) else check_observation(observation, "step's observation")
    return Step(checked, float(reward), bool(done), {str(k): float(v) for k, v in info.items()})


def _is_bool(value: Any) -> bool:
    """A Python or numpy bool (what gym environments return as `done`)."""
    return isinstance(value, bool) or (type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_"))
