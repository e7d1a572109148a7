"""Agent instances in worker processes: the executor runs in the engine, each episode's AgentInstance in a worker.

`isolate(executor, agent_path, workers, timeout)` swaps the executor's `agent_instance_cls` for a stand-in whose
`__init__`, `reset` and `step` run the file's real class in one of `workers` processes (rlhfkit.rewards.user_code
.PinnedWorkers, an episode pinned to one worker because its instance keeps state there). An exception, a call past
`timeout` seconds (the worker is killed and replaced) or a crash of the worker (os._exit, a segfault) raises
AgentFailure in the episode, which ends it as failed; a worker killed or crashed takes the other episodes pinned to
it with it. The workers stay up for the life of the engine process (one set per file), so later RL steps reuse them.
"""

from __future__ import annotations

import asyncio
import functools
import uuid
from typing import Any

from rlhfkit.agents.api import AgentExecutorBase, AgentFailure
from rlhfkit.errors import UserError

_WORKERS: dict[tuple[str, int, float], Any] = {}


def agent_workers(path: str, workers: int, timeout: float) -> Any:
    """The worker processes of an agent file in this process (started once, reused by every step)."""
    from rlhfkit.agents.openrlhf_compat import IMPORT_ALIASES
    from rlhfkit.rewards.user_code import PinnedWorkers, UserCodeLoadError

    key = (path, workers, timeout)
    if key not in _WORKERS:
        try:
            _WORKERS[key] = PinnedWorkers(path, workers=workers, timeout=timeout, import_aliases=IMPORT_ALIASES)
        except UserCodeLoadError as e:
            raise UserError(f"agent {path}: importing it in a worker failed ({e})") from None
    return _WORKERS[key]


async def _remote(fn: Any, *args: Any, **kwargs: Any) -> Any:
    result = await asyncio.get_running_loop().run_in_executor(None, functools.partial(fn, *args, **kwargs))
    if not result.ok:
        raise AgentFailure(result.kind, result.error)
    return result.value


def isolate(executor: AgentExecutorBase, agent_path: str, workers: int, timeout: float) -> list[str]:
    """Make `executor` create its AgentInstances in worker processes; returns the list that collects their keys
    (drop them with `release` after the episodes)."""
    real = executor.agent_instance_cls
    pool = agent_workers(agent_path, workers, timeout)
    name = getattr(real, "__name__", "")
    if name not in pool.functions:
        raise UserError(f"agent {agent_path}: the AgentInstance class given to the executor ({name or real!r}) is not "
                        "defined at the top level of the file, where a worker can find it")
    keys: list[str] = []

    class RemoteAgentInstance:
        # An async __init__ (OpenRLHF's AgentInstance allows one); create_instance awaits it.
        async def __init__(self, *args: Any, **kwargs: Any) -> None:  # type: ignore[misc]
            self.key = uuid.uuid4().hex
            keys.append(self.key)
            await _remote(pool.new, name, self.key, *args, **kwargs)

        async def reset(self, states: dict, **kwargs: Any) -> Any:
            return await _remote(pool.call, self.key, "reset", states, **kwargs)

        async def step(self, states: dict, **kwargs: Any) -> Any:
            return await _remote(pool.call, self.key, "step", states, **kwargs)

    executor.agent_instance_cls = RemoteAgentInstance
    executor.step_timeout = None  # the workers time calls out (and kill what hangs, blocking code included)
    return keys


def isolate_run_agent(executor: Any, agent_path: str, workers: int, timeout: float) -> list[str]:
    """Make an OpenAI executor run `run_agent` in worker processes: each episode builds the file's `AgentExecutor()`
    in a worker (with the run's max_steps / max_length) and calls its `run_agent` there, which reaches the episode's
    endpoint over 127.0.0.1 as before, all in one call (`PinnedWorkers.once`). An exit, a crash or a call past
    `timeout` seconds (killed) costs the episode. Returns the (empty) key list of `isolate`: nothing to release."""
    pool = agent_workers(agent_path, workers, timeout)
    bound = {"max_steps": executor.max_steps, "max_length": executor.max_length}

    async def run_agent(base_url: str, prompt: str, label: Any) -> Any:
        return await _remote(pool.once, "AgentExecutor", "run_agent", bound, base_url, prompt, label)

    executor.run_agent_remote = run_agent
    return []


def release(agent_path: str, workers: int, timeout: float, keys: list[str]) -> None:
    pool = _WORKERS.get((agent_path, workers, timeout))
    if pool is not None:
        for key in keys:
            pool.drop(key)
