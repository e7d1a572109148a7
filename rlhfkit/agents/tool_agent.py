"""Native tool calling for agent files: `ToolAgent` (one episode's environment) and `ToolAgentExecutor`.

An agent file lists its tools and scores the final answer:

    def calculator(expression: str) -> str:
        '''Evaluate an arithmetic expression.

        Args:
            expression: e.g. "12*34".
        '''
        ...

    class AgentInstance(ToolAgent):
        tools = [calculator]              # typed functions, or tool_from_schema(schema, fn)
        def final_reward(self, answer, label):
            return float(answer.strip() == str(label))

    class AgentExecutor(ToolAgentExecutor):
        def __init__(self):
            super().__init__(AgentInstance)

The episode (token in, token out, as every agent in rlhfkit.agents.api): `reset` renders the prompt as the user
message through the tokenizer's chat template with `tools=` (the model's own tool format). Each turn the sampled
text is parsed for tool calls (rlhfkit.agents.tool_parsers; the format detected from the chat template's markers,
or `--tool_format`); the calls run in the user-code worker pool with the run's timeout (rlhfkit.agents.tools); the
results become `tool` messages, and the feedback is the text the chat template renders after the assistant's turn
for them (its end-of-turn marker unless the model sampled it, the tool messages, the next generation prompt):
tokenised once by the executor and masked out of the loss, while the model's turns keep their exact sampled ids. A
turn without a tool call is the final answer: `final_reward(answer, label)` is the episode's reward.

A malformed or partial call, an unknown tool, arguments that do not fit the schema, and a tool that raises or hangs
all cost only that call: the model reads an `error: ...` tool message and the episode goes on; `extra_logs` count
them (`tool_calls`, `tool_errors`: malformed calls, `tool_failures`: calls that failed to run, `valid_call_rate`).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Sequence
from typing import Any

from rlhfkit.agents.api import AgentInstanceBase, MultiTurnAgentExecutor
from rlhfkit.agents.tool_parsers import FORMATS, ParsedCalls, detect_format, parse_tool_calls
from rlhfkit.agents.tools import Tool, argument_errors, as_tools, run_tool
from rlhfkit.errors import UserError

_SENTINEL = "\x00rlhfkit-assistant-turn\x00"  # where the assistant's content sits in a rendering


def render(tokenizer: Any, messages: list[dict[str, Any]], tools: Sequence[Tool], generation_prompt: bool) -> str:
    """The chat template's text of `messages` with the tools' schemas."""
    try:
        return str(tokenizer.apply_chat_template(messages, tools=[t.schema for t in tools] or None, tokenize=False,
                                                 add_generation_prompt=generation_prompt))
    except Exception as e:  # noqa: BLE001 - a template that cannot render tools or tool messages is the user's
        raise UserError(f"tool agent: the chat template cannot render this conversation with tools "
                        f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); pass one that does with "
                        "--tokenizer_chat_template") from None


def feedback_text(tokenizer: Any, history: list[dict[str, Any]], tool_messages: list[dict[str, Any]],
                  tools: Sequence[Tool], sampled_last: str = "") -> str:
    """The text the chat template writes after the last assistant turn for `tool_messages` and the next generation
    prompt: the delta of the rendered conversation. `sampled_last`: the special token the model ended its turn
    with (e.g. eos), which the context already holds, so the delta leaves it out."""
    turn = {"role": "assistant", "content": _SENTINEL}
    text = render(tokenizer, [*history, turn, *tool_messages], tools, generation_prompt=True)
    delta = text[text.rindex(_SENTINEL) + len(_SENTINEL):]
    if sampled_last and delta.startswith(sampled_last):
        delta = delta[len(sampled_last):]
    return delta


def action_text(tokenizer: Any, states: dict) -> tuple[str, str]:
    """(the turn's text with special tokens, the special token it ended with or ""): the ended token is left out,
    since the context already holds it and the template's delta must not repeat it."""
    ids = states.get("action_ids")
    if not ids:
        return str(states["action_text"]), ""
    last = tokenizer.convert_ids_to_tokens(int(ids[-1]))
    ended = last if last in tokenizer.all_special_tokens else ""
    text = tokenizer.decode(ids[:-1] if ended else ids, skip_special_tokens=False)
    return text, ended


class ToolAgent(AgentInstanceBase):
    """One tool-calling episode (see the module docstring). Subclasses set `tools` and override `final_reward`."""

    tools: Sequence[Any] = ()
    system_prompt: str | None = None
    max_calls_per_turn = 4
    tool_workers = 2

    def __init__(self, tokenizer: Any = None, tool_format: str | None = None, tool_timeout: float = 30.0) -> None:
        if tokenizer is None:
            raise TypeError("ToolAgent needs the run's tokenizer: build it through ToolAgentExecutor")
        self.tokenizer = tokenizer
        self.declared = as_tools(type(self).tools)
        self.by_name = {t.name: t for t in self.declared}
        self.format = resolve_format(tokenizer, tool_format)
        self.tool_timeout = tool_timeout
        self.messages: list[dict[str, Any]] = []
        self.counts = {"tool_calls": 0, "tool_errors": 0, "tool_failures": 0}
        self.turn_calls: list[dict[str, Any]] = []  # the last turn's calls and results

    def final_reward(self, answer: str, label: Any) -> float:
        """The episode's reward for its final answer (a turn without a tool call). Override."""
        raise NotImplementedError("ToolAgent subclasses define final_reward(answer, label)")

    async def reset(self, states: dict, **kwargs: Any) -> dict:
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        self.messages = [*system, {"role": "user", "content": str(states["observation"])}]
        text = render(self.tokenizer, self.messages, self.declared, generation_prompt=True)
        bos = self.tokenizer.bos_token
        if bos and text.startswith(bos):  # the executor puts bos before the prompt's ids itself
            text = text[len(bos):]
        return {"observation": text}

    async def step(self, states: dict, **kwargs: Any) -> dict:
        text, ended = action_text(self.tokenizer, states)
        parsed = parse_tool_calls(text, self.format)
        history = list(self.messages)
        self.messages.append({"role": "assistant", "content": text})
        if not parsed.attempted:
            reward = float(self.final_reward(parsed.content or text, states.get("label")))
            return {"rewards": reward, "scores": reward, "done": True, "environment_feedback": "",
                    "sampling_params": states.get("sampling_params"), "extra_logs": self._logs(final=1.0)}
        results = await self._run(parsed)
        self.messages += results
        feedback = feedback_text(self.tokenizer, history, results, self.declared, ended)
        return {"rewards": 0.0, "scores": 0.0, "done": False, "environment_feedback": feedback,
                "sampling_params": states.get("sampling_params"), "extra_logs": self._logs(final=0.0),
                "tool_calls": self.turn_calls}

    def _logs(self, final: float) -> dict[str, float]:
        calls = self.counts["tool_calls"] + self.counts["tool_errors"]
        valid = self.counts["tool_calls"] - self.counts["tool_failures"]
        return {**{k: float(v) for k, v in self.counts.items()}, "answered": final,
                "valid_call_rate": valid / calls if calls else 0.0}

    async def _run(self, parsed: ParsedCalls) -> list[dict[str, Any]]:
        """The tool messages answering this turn's calls (results or error lines), in the calls' order; the
        calls with their results stay in `turn_calls` (for the run report's trace viewer)."""
        outs: list[dict[str, Any]] = [{"name": None, "arguments": None, "result": f"error: {e}", "ok": False}
                                      for e in parsed.errors]
        self.counts["tool_errors"] += len(parsed.errors)
        for i, call in enumerate(parsed.calls):
            self.counts["tool_calls"] += 1
            tool = self.by_name.get(call.name)
            problem = (f"unknown tool {call.name!r} (tools: {', '.join(self.by_name)})" if tool is None else
                       "more calls in one turn than max_calls_per_turn" if i >= self.max_calls_per_turn else
                       argument_errors(tool, call.arguments))
            if problem or tool is None:
                self.counts["tool_failures"] += 1
                outs.append({"name": call.name, "arguments": call.arguments, "result": f"error: {problem}",
                             "ok": False})
                continue
            result, failure = await asyncio.get_running_loop().run_in_executor(
                None, functools.partial(run_tool, tool, call.arguments, self.tool_timeout, self.tool_workers))
            self.counts["tool_failures"] += bool(failure)
            outs.append({"name": call.name, "arguments": call.arguments, "result": result, "ok": not failure})
        self.turn_calls = outs
        base = len(self.messages)
        return [{"role": "tool", "name": out["name"] or "error", "content": out["result"],
                 "tool_call_id": f"call{base + i:05d}"} for i, out in enumerate(outs)]


def resolve_format(tokenizer: Any, tool_format: str | None) -> str:
    """The tool-call format: `--tool_format`, else the one the chat template's markers show."""
    if tool_format:
        if tool_format not in FORMATS:
            raise UserError(f"--tool_format {tool_format}: use one of {', '.join(FORMATS)}")
        return tool_format
    found = detect_format(getattr(tokenizer, "chat_template", None))
    if found is None:
        raise UserError("tool agent: the tokenizer's chat template shows no tool-call format (<tool_call>, "
                        "<|python_tag|> or [TOOL_CALLS]); pass --tool_format hermes|llama3|mistral, or a template "
                        "that renders tools with --tokenizer_chat_template")
    return found


class ToolAgentExecutor(MultiTurnAgentExecutor):
    """The executor of a ToolAgent: builds each episode's instance with the run's tokenizer, tool format and
    timeout. The tools are checked (schemas derived and validated) when the executor is made, before any episode.
    Its instances run in the engine process (`isolate_instances`): they hold the tokenizer, and what runs user code
    that may hang or crash, the tools, runs in the user-code worker pool."""

    isolate_instances = False

    def __init__(self, agent_instance_cls: type[ToolAgent]):
        if not (isinstance(agent_instance_cls, type) and issubclass(agent_instance_cls, ToolAgent)):
            raise UserError(f"ToolAgentExecutor needs a ToolAgent subclass, got {agent_instance_cls!r}")
        as_tools(agent_instance_cls.tools)
        super().__init__(agent_instance_cls)
        self.tool_cls = agent_instance_cls

    def bind(self, *, max_steps: int, max_length: int, llm_engine: Any, hf_tokenizer: Any,
             step_timeout: float | None = None, tool_format: str | None = None) -> ToolAgentExecutor:
        super().bind(max_steps=max_steps, max_length=max_length, llm_engine=llm_engine, hf_tokenizer=hf_tokenizer,
                     step_timeout=step_timeout, tool_format=tool_format)
        resolve_format(hf_tokenizer, tool_format)  # a template without a tool format stops before any episode
        # The instances run here (their tools run in worker processes); the run's timeout bounds each tool call.
        self.agent_instance_cls = functools.partial(  # type: ignore[assignment]  # a factory, called as the class is
            self.tool_cls, hf_tokenizer, tool_format, step_timeout or 30.0)
        self.step_timeout = None  # a step waits on its tools' own timeouts
        return self
