"""Running many agent episodes at once inside a rollout engine (asyncio), with their generation calls batched.

`run_episodes(generate, tokenizer, agent_path, requests, ...)` loads the agent file's `AgentExecutor`, builds it in
whichever of OpenRLHF's two forms it is written (constructor arguments or none), and runs one `execute` per request
concurrently. Every `await llm_engine.generate(...)` of the episodes lands in a `BatchingGenerator`, which waits
until every running episode waits on a generation (or nothing new arrived for `IDLE_S`: an episode busy in its
environment), then hands all waiting contexts to the engine in one `generate` call per token budget.
"""

from __future__ import annotations

import asyncio
import importlib.util
import inspect
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rlhfkit.agents.api import AgentExecutorBase, AgentFailure, Episode, Prompt
from rlhfkit.agents.openrlhf_compat import (
    IMPORT_ALIASES,
    OpenRLHFEngine,
    SamplingParams,
    episode_from_dict,
    takes_engine,
)
from rlhfkit.errors import UserError
from rlhfkit.rewards.user_code_worker import aliased_imports

SAMPLING_KEYS = ("temperature", "top_p", "top_k")


class BatchingGenerator:
    """`await generate(context_ids, max_new_tokens, sampling_params)` for concurrent episodes, batched.

    `engine_generate(prompt_ids, max_new_tokens=..., seed=..., **sampling)` is the engine's own batch generate.
    Request i of batch call k samples with seed + 1_000 * k + i (reproducible for a given arrival order)."""

    IDLE_S = 0.05  # no new request for this long: the episodes not waiting yet are busy in their environments

    def __init__(self, engine_generate: Callable[..., list], sampling: dict[str, Any], seed: int | None):
        self.engine_generate = engine_generate
        self.sampling = dict(sampling)
        self.seed = seed
        self.calls = 0
        self.active = 0  # episodes still running (run_episodes counts them)
        self.batch_sizes: list[int] = []
        self._pending: list[tuple[list[int], int, asyncio.Future]] = []
        self._flushing = False
        self._arrived: asyncio.Event | None = None

    def episode_finished(self) -> None:
        self.active -= 1
        if self._arrived is not None:
            self._arrived.set()

    async def generate(self, context_ids: Sequence[int], max_new_tokens: int, sampling_params: Any = None) -> Any:
        self._check(sampling_params)
        future = asyncio.get_running_loop().create_future()
        self._pending.append((list(context_ids), int(max_new_tokens), future))
        if self._arrived is not None:
            self._arrived.set()
        if not self._flushing:
            self._flushing = True
            asyncio.get_running_loop().create_task(self._flush())
        return await future

    def _check(self, sampling_params: Any) -> None:
        """The policy's log-probs are trained at the run's temperature / top-p / top-k: an agent may pass the
        sampling params back unchanged (the template of OpenRLHF's example agent does), not change them mid-episode."""
        if not isinstance(sampling_params, dict):
            return
        changed = {k: sampling_params[k] for k in SAMPLING_KEYS
                   if k in sampling_params and sampling_params[k] != self.sampling.get(k)}
        if changed:
            raise UserError(f"agent: sampling_params {changed} differ from the run's ({self.sampling}); the "
                            "trainer's log-probs would not match the sampled tokens: set them with flags")

    async def _flush(self) -> None:
        self._arrived = asyncio.Event()
        while len(self._pending) < self.active:
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), self.IDLE_S)
            except asyncio.TimeoutError:
                break
        batch, self._pending, self._flushing = self._pending, [], False
        by_budget: dict[int, list[tuple[list[int], asyncio.Future]]] = {}
        for ids, budget, future in batch:
            by_budget.setdefault(budget, []).append((ids, future))
        for budget, items in by_budget.items():
            seed = None if self.seed is None else self.seed + 1_000 * self.calls
            self.calls += 1
            self.batch_sizes.append(len(items))
            try:
                samples = self.engine_generate([ids for ids, _ in items], max_new_tokens=budget, seed=seed,
                                               **self.sampling)
            except Exception as e:  # noqa: BLE001 - every waiting episode learns of it
                for _, future in items:
                    future.set_exception(e)
                continue
            for (_, future), sample in zip(items, samples):
                future.set_result(sample)


def load_agent_executor(path: str) -> type:
    """The `AgentExecutor` class of an agent file (imported in this process)."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise UserError(f"--agent_func_path {path}: no such file")
    spec = importlib.util.spec_from_file_location(f"rlhfkit_agent_{abs(hash(str(file.resolve())))}", file)
    if spec is None or spec.loader is None:
        raise UserError(f"--agent_func_path {path}: not a Python file that can be imported")
    module = importlib.util.module_from_spec(spec)
    try:
        with aliased_imports(IMPORT_ALIASES):  # `from openrlhf.utils.agent import ...` as OpenRLHF's files write it
            spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 - any failure while importing is the user's file
        hint = (f"; rlhfkit provides {', '.join(IMPORT_ALIASES)} of openrlhf" if isinstance(e, ImportError)
                and "openrlhf" in str(e) else "")
        raise UserError(f"agent {path}: importing it failed ({type(e).__name__}: {e}){hint}") from e
    cls = getattr(module, "AgentExecutor", None)
    if not (inspect.isclass(cls) and issubclass(cls, AgentExecutorBase)):
        raise UserError(f"agent {path}: defines no class AgentExecutor(AgentExecutorBase or MultiTurnAgentExecutor) "
                        "(import them from rlhfkit.agents)")
    return cls


def make_executor(cls: type[Any], max_steps: int, max_length: int, llm_engine: Any, tokenizer: Any,
                  step_timeout: float | None = None, tool_format: str | None = None) -> AgentExecutorBase:
    """Build the file's AgentExecutor in the form it is written in, then bind what the run provides."""
    params = [p for p in inspect.signature(cls.__init__).parameters.values()
              if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    # OpenRLHF 0.11's executors that drive the engine themselves define no __init__ (its base takes none)
    own_init = cls.__init__ is not AgentExecutorBase.__init__
    executor = cls(max_steps, max_length, llm_engine, tokenizer, None) if params and own_init else cls()
    tools = {"tool_format": tool_format} if tool_format else {}  # (a file's own bind() may predate the argument)
    return executor.bind(max_steps=max_steps, max_length=max_length, llm_engine=llm_engine, hf_tokenizer=tokenizer,
                         step_timeout=step_timeout, **tools)


def run_episodes(engine_generate: Callable[..., list], tokenizer: Any, agent_path: str,
                 requests: Sequence[dict[str, Any]], *, max_steps: int, max_length: int, seed: int | None = None,
                 step_timeout: float | None = None, agent_workers: int = 0, tool_format: str | None = None,
                 **sampling: Any) -> list[dict[str, Any]]:
    """One episode per request {"prompt": text, "prompt_ids": [...], "label": ...}, all at once; plain dicts
    (Episode fields plus "truncated") in request order. An AgentInstance that raises or whose reset/step takes
    longer than `step_timeout` seconds ends its own episode as failed (an `async` step is cancelled; a blocking one
    cannot be interrupted here). With `agent_workers` > 0 the AgentInstances run in that many worker processes
    (rlhfkit.agents.isolation), where a crash or a blocking call past `step_timeout` costs the episode too; a tool
    agent's instances stay here (`isolate_instances = False`), its tools run in worker processes. `tool_format`:
    --tool_format, for tool agents."""
    cls = load_agent_executor(agent_path)
    llm = BatchingGenerator(engine_generate, sampling, seed)
    executor = make_executor(cls, max_steps, max_length, llm, tokenizer, step_timeout, tool_format)
    keys: list[str] = []
    isolated = executor.agent_instance_cls is not None and getattr(executor, "isolate_instances", True)
    if agent_workers > 0 and isolated:  # (an endpoint-driven executor has no instances; a tool agent's run here)
        from rlhfkit.agents.isolation import isolate

        keys = isolate(executor, agent_path, agent_workers, step_timeout or 60.0)

    full_form = takes_engine(executor)

    async def one(request: dict[str, Any]) -> Episode:
        prompt = Prompt(request["prompt"], request["prompt_ids"])
        engine = OpenRLHFEngine(llm, tokenizer, max_length)
        params = SamplingParams(llm.sampling, max_tokens=max_length, logprobs=1)
        try:
            if not full_form:  # OpenRLHF's example form: execute(prompt, label, sampling_params)
                return await executor.execute(prompt, request.get("label"), dict(llm.sampling))
            out = await executor.execute(prompt, request.get("label"), params, max_length, tokenizer, engine)
            return out if isinstance(out, Episode) else episode_from_dict(out, engine, max_length)
        except AgentFailure as failure:  # a malformed dict from OpenRLHF 0.11's execute: this episode fails
            return Episode(prompt_ids=list(prompt.token_ids), finish="failed", error=f"{failure.kind}: {failure}")
        finally:
            llm.episode_finished()

    async def run_all() -> list[Episode]:
        llm.active = len(requests)
        return list(await asyncio.gather(*[one(r) for r in requests]))

    try:
        episodes = asyncio.run(run_all())
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 - the user's agent failed; say where
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise UserError(f"agent {agent_path}: an episode raised {type(e).__name__}: {first}") from e
    finally:
        if keys:
            from rlhfkit.agents.isolation import release

            release(agent_path, agent_workers, step_timeout or 60.0, keys)
    out = []
    for episode in episodes:
        if not isinstance(episode, Episode):
            raise UserError(f"agent {agent_path}: AgentExecutor.execute returned {type(episode).__name__}; return "
                            "what super().execute(...) returns")
        out.append({**asdict(episode), "truncated": episode.truncated, "batch_sizes": llm.batch_sizes})
    return out


def episodes_to_samples(episodes: Sequence[dict[str, Any]], fallback: float = 0.0, max_failure_ratio: float = 1.0,
                        where: str = "agent", prompts: Sequence[str] | None = None) -> tuple[list[Any], dict[str, Any]]:
    """The RL loop's view of finished episodes: SampledSequences (with their action masks) and the reward
    output ({"rewards", "scores", "extra_logs", "metrics"}) with the per-episode metrics under agent/. A failed
    episode keeps its tokens and gets `fallback` as reward and score; more than `max_failure_ratio` of them failed
    (any, with 0) is a UserError naming the agent, the first failure and its prompt."""
    import torch

    from rlhfkit.rollout.engine import FINISH_LENGTH, FINISH_STOP, SampledSequence

    samples = [SampledSequence(list(e["prompt_ids"]), list(e["response_ids"]), list(e["logprobs"]),
                               FINISH_LENGTH if e["truncated"] else FINISH_STOP, list(e["action_mask"]))
               for e in episodes]
    n = max(len(episodes), 1)
    logs: dict[str, float] = {}
    for key in {k for e in episodes for k in e["extra_logs"]}:
        values = [e["extra_logs"][key] for e in episodes if key in e["extra_logs"]]
        logs[key] = sum(values) / len(values)
    sizes = [s for e in episodes[:1] for s in e.get("batch_sizes", [])]
    metrics = {"agent/turns": sum(e["turns"] for e in episodes) / n,
               "agent/feedback_tokens": sum(e["feedback_tokens"] for e in episodes) / n,
               "agent/truncated": sum(bool(e["truncated"]) for e in episodes) / n,
               "agent/done": sum(e["finish"] == "done" for e in episodes) / n,
               "agent/generate_batch_max": float(max(sizes, default=0))}
    failed = [i for i, e in enumerate(episodes) if e["finish"] == "failed"]
    if failed and len(failed) > max_failure_ratio * len(episodes):
        first = failed[0]
        sample = repr(prompts[first][:160]) if prompts else ""
        limit = ("--max_reward_failure_ratio 0 allows none" if max_failure_ratio == 0 else
                 f"more than --max_reward_failure_ratio {max_failure_ratio:g}")
        raise UserError(f"{where}: {episodes[first]['error']}; {len(failed)} of {len(episodes)} episodes failed this "
                        f"step ({limit}); e.g. episode {first}: {sample}")
    kinds: dict[str, int] = {}
    for i in failed:
        kind = episodes[i]["error"].split(":", 1)[0]
        kinds[kind] = kinds.get(kind, 0) + 1
    metrics.update({"agent/failures": float(len(failed)),
                    **{f"agent/failure_kinds/{k}": float(v) for k, v in kinds.items()}})
    rewards = [fallback if e["finish"] == "failed" else float(e["reward"]) for e in episodes]
    scores = [fallback if e["finish"] == "failed" else float(e["score"]) for e in episodes]
    reward = {"rewards": torch.tensor(rewards), "scores": torch.tensor(scores), "extra_logs": logs,
              "metrics": metrics}
    return samples, reward
