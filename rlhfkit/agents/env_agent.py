"""Environments (rlhfkit.agents.environment) on the agent API: `EnvironmentAgent` is an `AgentInstance` that drives
one episode's `Environment`, and `EnvironmentExecutor` the executor that builds them, so an environment runs in the
same multi-turn loop as every agent (token in, token out; feedback masked out of the loss), with the tool layer's
chat rendering and call parsing (rlhfkit.agents.tool_agent, tool_parsers) in chat mode.

An environment file given with `--agent_func_path` defines one `Environment` subclass and no `AgentExecutor`; the
loader (`environment_executor`) makes the executor. A file may also write it out, in either generation of the agent
API: an Environment class goes where an AgentInstance class goes (`bind_environment` puts the adapter there):

    class AgentExecutor(AgentExecutorBase):           # OpenRLHF's example form
        def __init__(self, max_steps, max_length, llm_engine, hf_tokenizer, result_queue):
            super().__init__(GuessTheNumber, max_steps, max_length, llm_engine, hf_tokenizer, result_queue)

    class AgentExecutor(MultiTurnAgentExecutor):      # OpenRLHF 0.11's form
        def __init__(self):
            super().__init__(GuessTheNumber)

Where the code runs: the adapter (it holds the tokenizer) in the engine process; the environment itself, the user's
code, in the agent worker processes (`--reward_workers`, rlhfkit.agents.isolation.agent_workers), one object per
episode pinned to one worker, every `reset`/`step` bounded by `--reward_timeout`. Without workers
(`run_episodes(..., agent_workers=0)`, unit tests) it runs here, bounded by the executor's step timeout.
"""

from __future__ import annotations

import functools
import inspect
import uuid
from typing import Any

from rlhfkit.agents.api import AgentFailure, AgentInstanceBase, MultiTurnAgentExecutor
from rlhfkit.agents.environment import Action, Environment, Observation, check_reset, check_step
from rlhfkit.agents.isolation import _remote, agent_workers
from rlhfkit.agents.tool_agent import ToolAgent, action_text, feedback_text, render, resolve_format
from rlhfkit.agents.tool_parsers import parse_tool_calls
from rlhfkit.agents.tools import as_tools
from rlhfkit.errors import UserError


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


class LocalEnvironment:
    """The environment object in this process (no workers)."""

    def __init__(self, cls: type[Environment]):
        self.env = cls()

    async def reset(self, prompt: str, label: Any) -> Any:
        return await _maybe_await(self.env.reset(prompt, label))

    async def step(self, action: Action) -> Any:
        return await _maybe_await(self.env.step(action))


class RemoteEnvironment:
    """The environment object in an agent worker process; its failures (exception, timeout, crash) raise
    AgentFailure, which costs the episode."""

    def __init__(self, pool: Any, name: str, keys: list[str]):
        self.pool, self.name, self.key = pool, name, uuid.uuid4().hex
        self.started = False
        keys.append(self.key)  # dropped from its worker after the episodes (isolation.release)

    async def _call(self, method: str, *args: Any) -> Any:
        if not self.started:
            await _remote(self.pool.new, self.name, self.key)
            self.started = True
        return await _remote(self.pool.call, self.key, method, *args)

    async def reset(self, prompt: str, label: Any) -> Any:
        return await self._call("reset", prompt, label)

    async def step(self, action: Action) -> Any:
        return await self._call("step", action)


class EnvironmentBinding:
    """An Environment class given to an executor where an AgentInstance class goes, with what the run provides (the
    tokenizer, the tool format) and, once isolated, the worker pool its objects live in."""

    def __init__(self, env_cls: type[Environment], tokenizer: Any, tool_format: str | None):
        self.env_cls, self.tokenizer, self.tool_format = env_cls, tokenizer, tool_format
        self.remote: tuple[Any, list[str]] | None = None  # (the pool, the keys of the objects made there)

    def isolate(self, agent_path: str, workers: int, timeout: float) -> list[str]:
        """Make the environments in the file's agent workers; returns the list of their keys (to release)."""
        pool = agent_workers(agent_path, workers, timeout)
        if self.env_cls.__name__ not in pool.functions:
            raise UserError(f"agent {agent_path}: environment {self.env_cls.__name__} is not defined at the top "
                            "level of the file, where a worker can find it")
        keys: list[str] = []
        self.remote = (pool, keys)
        return keys

    def make(self) -> LocalEnvironment | RemoteEnvironment:
        if self.remote is None:
            return LocalEnvironment(self.env_cls)
        return RemoteEnvironment(self.remote[0], self.env_cls.__name__, self.remote[1])


class EnvironmentAgent(AgentInstanceBase):
    """One episode of an environment, as an AgentInstance (see the module docstring)."""

    def __init__(self, binding: EnvironmentBinding) -> None:
        self.tokenizer = binding.tokenizer
        self.tools = as_tools(binding.env_cls.tools)
        self.format = resolve_format(self.tokenizer, binding.tool_format) if self.tools else None
        self.chat = bool(self.tools)
        self.env = binding.make()
        self.system_prompt = binding.env_cls.system_prompt
        self.messages: list[dict[str, Any]] = []
        self.counts = {"tool_calls": 0, "tool_errors": 0}

    async def reset(self, states: dict, **kwargs: Any) -> dict:
        first = check_reset(await self.env.reset(str(states["observation"]), states.get("label")))
        if isinstance(first, list):
            self.chat = True
        if not self.chat:
            return {"observation": first}
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        self.messages = first if isinstance(first, list) else [*system, {"role": "user", "content": first}]
        text = render(self.tokenizer, self.messages, self.tools, generation_prompt=True)
        bos = self.tokenizer.bos_token
        return {"observation": text[len(bos):] if bos and text.startswith(bos) else text}

    def _action(self, states: dict) -> tuple[Action, str]:
        """(the turn as an Action, the special token it ended with or "")."""
        if not self.chat:
            return Action(text=str(states["action_text"]), content=str(states["action_text"])), ""
        text, ended = action_text(self.tokenizer, states)
        if self.format is None:
            return Action(text=text, content=text), ended
        parsed = parse_tool_calls(text, self.format)
        self.counts["tool_calls"] += len(parsed.calls)
        self.counts["tool_errors"] += len(parsed.errors)
        return Action(text=text, content=parsed.content, tool_calls=parsed.calls, call_errors=parsed.errors), ended

    def _feedback(self, observation: Observation, action: Action, ended: str) -> str:
        """The observation as the text appended to the context: as it is (text mode), or the chat template's delta
        after the assistant's turn (chat mode; a string is a user message)."""
        if not self.chat:
            if not isinstance(observation, str):
                raise AgentFailure("bad_output", "step returned messages, but the environment is in text mode (no "
                                                 "tools, and reset returned a string): return text, or messages "
                                                 "from reset too")
            return observation
        history = list(self.messages)
        self.messages.append({"role": "assistant", "content": action.text})
        new = observation if isinstance(observation, list) else (
            [{"role": "user", "content": observation}] if observation else [])
        self.messages += new
        return feedback_text(self.tokenizer, history, new, self.tools, ended)

    async def step(self, states: dict, **kwargs: Any) -> dict:
        action, ended = self._action(states)
        step = check_step(await self.env.step(action))
        feedback = "" if step.done else self._feedback(step.observation, action, ended)
        logs = {**{k: float(v) for k, v in self.counts.items()}, **step.info} if self.tools else dict(step.info)
        return {"rewards": step.reward, "done": step.done, "environment_feedback": feedback,
                "sampling_params": states.get("sampling_params"), "extra_logs": logs,
                "tool_calls": traced_calls(action, step.observation)}


def traced_calls(action: Action, observation: Observation) -> list[dict[str, Any]]:
    """The turn's calls for the run report's trace viewer ([{"name", "arguments", "result", "ok"}]): the malformed
    ones, then the parsed ones (the order `Environment.call_tools` answers in), each with the `tool` message at its
    place in the observation; a result is left empty when the environment answered in another shape."""
    calls: list[dict[str, Any]] = [{"name": None, "arguments": None, "result": f"error: {e}", "ok": False}
                                   for e in action.call_errors]
    calls += [{"name": c.name, "arguments": c.arguments, "result": "", "ok": True} for c in action.tool_calls]
    results = [m["content"] for m in observation if m.get("role") == "tool"] if isinstance(observation, list) else []
    if len(results) == len(calls):
        for call, result in zip(calls, results):
            call["result"], call["ok"] = result, not result.startswith("error:")
    return calls


def check_environment_class(cls: Any, where: str) -> type[Environment]:
    """An Environment subclass with valid tool declarations; UserError (one line) otherwise."""
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise UserError(f"{where}: environment_cls must be an Environment subclass, got {cls!r}")
    try:
        as_tools(cls.tools)
    except UserError as e:
        raise UserError(f"{where}: environment {cls.__name__}: {e}") from None
    return cls


def bind_environment(executor: Any, tool_format: str | None) -> None:
    """When the executor was given an Environment class in place of an AgentInstance class (either generation:
    `super().__init__(MyEnvironment, max_steps, ...)` or `super().__init__(MyEnvironment)`), put the adapter there;
    the run's `_isolate` then moves the environments to the workers (`executor.environment.isolate`). A template
    without a tool format for its tools stops here, before any episode."""
    cls = executor.agent_instance_cls
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        return
    check_environment_class(cls, "AgentExecutor")
    if cls.tools:
        resolve_format(executor.hf_tokenizer, tool_format)
    executor.environment = EnvironmentBinding(cls, executor.hf_tokenizer, tool_format)
    executor.agent_instance_cls = functools.partial(EnvironmentAgent, executor.environment)


class EnvironmentExecutor(MultiTurnAgentExecutor):
    """The executor of an environment file (module docstring): OpenRLHF 0.11's form, given the environment class."""

    environment_cls: type[Environment] | None = None

    def __init__(self) -> None:
        super().__init__(check_environment_class(type(self).environment_cls, "EnvironmentExecutor"))


def environment_executor(module: Any, path: str) -> type | None:
    """The executor class of an environment file (one Environment subclass, no AgentExecutor): made for it; None for
    a file that defines an AgentExecutor or no environment. Checks the tools of the file's ToolAgent and Environment
    classes on the way, so that a bad declaration stops with one line before any model loads."""
    for value in vars(module).values():
        if isinstance(value, type) and issubclass(value, ToolAgent) and value.__module__ == module.__name__:
            try:
                as_tools(value.tools)
            except UserError as e:
                raise UserError(f"agent {path}: {value.__name__}: {e}") from None
    envs = [v for v in vars(module).values()
            if isinstance(v, type) and issubclass(v, Environment) and v.__module__ == module.__name__]
    for env in envs:
        check_environment_class(env, f"agent {path}")
    if not envs or getattr(module, "AgentExecutor", None) is not None:
        return None
    if len(envs) > 1:
        raise UserError(f"agent {path}: defines {len(envs)} Environment classes "
                        f"({', '.join(e.__name__ for e in envs)}); an environment file defines one (or an "
                        "AgentExecutor(EnvironmentExecutor) naming it as environment_cls)")
    return type("AgentExecutor", (EnvironmentExecutor,), {"environment_cls": envs[0], "__module__": module.__name__})
