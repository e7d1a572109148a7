"""Running many agent episodes at once inside a rollout engine (asyncio), with their generation calls batched.

`run_episodes(generate, tokenizer, agent_path, requests, ...)` loads the agent file's `AgentExecutor`, builds it in
whichever of OpenRLHF's two forms it is written (constructor arguments or none), and runs one `execute` per request
concurrently. Every `await llm_engine.generate(...)` of the episodes lands in a `BatchingGenerator`, which waits
until every running episode waits on a generation (or nothing new arrived for `IDLE_S`: an episode busy in its
environment), then hands all waiting contexts to the engine in one `generate` call per token budget.
"""

from __future__ import annotations

import asyncio
import contextvars
import importlib.util
import inspect
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rlhfkit.agents.api import FINISH_FAILED, AgentExecutorBase, AgentFailure, Episode, Prompt
from rlhfkit.agents.env_agent import bind_environment, environment_executor
from rlhfkit.agents.episode_versions import Call, token_versions
from rlhfkit.agents.image_feedback import EpisodeImages
from rlhfkit.agents.openrlhf_compat import (
    IMPORT_ALIASES,
    OpenRLHFEngine,
    SamplingParams,
    episode_from_dict,
    takes_engine,
)
from rlhfkit.agents.watchdog import LoopBlocked, LoopWatch
from rlhfkit.errors import UserError
from rlhfkit.rewards.user_code_worker import aliased_imports

SAMPLING_KEYS = ("temperature", "top_p", "top_k")
# The request index of the episode whose task makes a generate call (set per episode task by run_episodes).
EPISODE_INDEX: contextvars.ContextVar[int | None] = contextvars.ContextVar("rlhfkit_episode_index", default=None)


class BatchingGenerator:
    """`await generate(context_ids, max_new_tokens, sampling_params)` for concurrent episodes, batched.

    `engine_generate(prompt_ids, max_new_tokens=..., seed=..., **sampling)` is the engine's own batch generate.
    Request i of batch call k samples with seed + 1_000 * k + i (reproducible for a given arrival order).
    `traces` keeps each episode's calls whose samples carry policy versions (async --partial_rollout), for
    rlhfkit.agents.episode_versions."""

    IDLE_S = 0.05  # no new request for this long: the episodes not waiting yet are busy in their environments

    def __init__(self, engine_generate: Callable[..., list], sampling: dict[str, Any], seed: int | None):
        self.engine_generate = engine_generate
        self.sampling = dict(sampling)
        self.seed = seed
        self.calls = 0
        self.active = 0  # episodes still running (run_episodes counts them)
        self.batch_sizes: list[int] = []
        self._pending: list[tuple[list[int], int, asyncio.Future, int | None]] = []  # (.., the episode that asks)
        self.traces: dict[int, list[Call]] = {}
        self._flushing = False
        self._arrived: asyncio.Event | None = None
        self.watch: LoopWatch | None = None  # the loop's watchdog: engine calls block the loop on purpose
        self.engine_error: Exception | None = None  # the engine itself failed (not the agent's code)
        self.images = EpisodeImages(None)  # image prompts and image feedback (a vision-language policy)

    def episode_finished(self) -> None:
        self.active -= 1
        if self._arrived is not None:
            self._arrived.set()

    async def generate(self, context_ids: Sequence[int], max_new_tokens: int, sampling_params: Any = None) -> Any:
        self._check(sampling_params)
        future = asyncio.get_running_loop().create_future()
        self._pending.append((list(context_ids), int(max_new_tokens), future, EPISODE_INDEX.get()))
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
        by_budget: dict[int, list[tuple[list[int], asyncio.Future, int | None]]] = {}
        for ids, budget, future, episode in batch:
            by_budget.setdefault(budget, []).append((ids, future, episode))
        for budget, items in by_budget.items():
            seed = None if self.seed is None else self.seed + 1_000 * self.calls
            self.calls += 1
            self.batch_sizes.append(len(items))
            try:
                samples = self._engine_generate([ids for ids, _, _ in items], budget, seed, [e for _, _, e in items])
            except LoopBlocked as e:  # the episodes were given up; the caller may be using the engine now
                for _, future, _ in items:
                    future.set_exception(e)
                continue
            except Exception as e:  # noqa: BLE001 - every waiting episode learns of it
                self.engine_error = e
                for _, future, _ in items:
                    future.set_exception(e)
                continue
            for (ids, future, episode), sample in zip(items, samples):
                self._trace(episode, ids, sample)
                future.set_result(sample)

    def _trace(self, episode: int | None, context: list[int], sample: Any) -> None:
        versions = getattr(sample, "versions", None)
        if episode is not None and versions is not None:
            self.traces.setdefault(episode, []).append((len(context), list(sample.response_ids), list(versions)))

    def image_feedback(self, tokenizer: Any, text: str, images: list[Any]) -> tuple[list[int], Any]:
        """(ids, pixels) of a feedback text with images (`rlhfkit.agents.image_feedback`) for the asking episode."""
        return self.images.feedback_ids(tokenizer, text, images, f"agent episode {EPISODE_INDEX.get()}")

    def keep_images(self, pixels: Any) -> None:
        """Feedback images that joined the asking episode's context: its later turns see them."""
        self.images.keep(EPISODE_INDEX.get(), pixels)

    def _engine_generate(self, contexts: list[list[int]], budget: int, seed: int | None,
                         episodes: Sequence[int | None] = ()) -> list:
        rows = [self.images.of(e) for e in episodes]
        extra = {"images": rows} if any(r is not None for r in rows) else {}  # text episodes: the plain call
        if self.watch is None:
            return self.engine_generate(contexts, max_new_tokens=budget, seed=seed, **self.sampling, **extra)
        with self.watch.engine_call():
            return self.engine_generate(contexts, max_new_tokens=budget, seed=seed, **self.sampling, **extra)


_IMPORT_CHECKED: set[tuple[str, float]] = set()  # (file, mtime) imported once in a worker by this process


def _openrlhf_hint(error: str) -> str:
    return f"; rlhfkit provides {', '.join(IMPORT_ALIASES)} of openrlhf" if "openrlhf" in error and \
        "ModuleNotFoundError" in error else ""


def check_import_in_worker(file: Path, path: str, timeout: float) -> None:
    """Import the agent file once in a worker process before this process imports it: a module-level `os._exit`,
    `sys.exit`, hang (past `timeout` seconds) or exception stops the run with one line instead of ending or freezing
    this process. Once per file version and process."""
    key = (str(file.resolve()), os.stat(file).st_mtime)
    if key in _IMPORT_CHECKED:
        return
    from rlhfkit.rewards.user_code import PinnedWorkers, UserCodeLoadError

    try:
        PinnedWorkers(path, workers=1, timeout=timeout, start_timeout=timeout,
                      import_aliases=IMPORT_ALIASES).close()
    except UserCodeLoadError as e:
        raise UserError(f"agent {path}: importing it in a worker failed ({e}){_openrlhf_hint(str(e))}") from None
    _IMPORT_CHECKED.add(key)


def load_agent_executor(path: str, import_timeout: float = 60.0) -> type:
    """The `AgentExecutor` class of an agent file, imported in this process after a worker imported it
    (`check_import_in_worker`, bounded by `import_timeout` seconds)."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise UserError(f"--agent_func_path {path}: no such file")
    spec = importlib.util.spec_from_file_location(f"rlhfkit_agent_{abs(hash(str(file.resolve())))}", file)
    if spec is None or spec.loader is None:
        raise UserError(f"--agent_func_path {path}: not a Python file that can be imported")
    check_import_in_worker(file, path, import_timeout)
    module = importlib.util.module_from_spec(spec)
    try:
        with aliased_imports(IMPORT_ALIASES):  # `from openrlhf.utils.agent import ...` as OpenRLHF's files write it
            spec.loader.exec_module(module)
    except (Exception, SystemExit) as e:  # noqa: BLE001 - any failure while importing is the user's file
        hint = _openrlhf_hint(f"ModuleNotFoundError: {e}") if isinstance(e, ImportError) else ""
        raise UserError(f"agent {path}: importing it failed ({type(e).__name__}: {e}){hint}") from None
    cls = environment_executor(module, path) or getattr(module, "AgentExecutor", None)
    if not (inspect.isclass(cls) and issubclass(cls, AgentExecutorBase)):
        raise UserError(f"agent {path}: defines no class AgentExecutor(AgentExecutorBase or MultiTurnAgentExecutor) "
                        "and no Environment subclass (import them from rlhfkit.agents)")
    return cls


def make_executor(cls: type[Any], max_steps: int, max_length: int, llm_engine: Any, tokenizer: Any,
                  step_timeout: float | None = None, tool_format: str | None = None) -> AgentExecutorBase:
    """Build the file's AgentExecutor in the form it is written in, then bind what the run provides. Its
    `__init__` raising is the user's mistake: one line (UserError)."""
    params = [p for p in inspect.signature(cls.__init__).parameters.values()
              if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    # OpenRLHF 0.11's executors that drive the engine themselves define no __init__ (its base takes none)
    own_init = cls.__init__ is not AgentExecutorBase.__init__
    try:
        executor = cls(max_steps, max_length, llm_engine, tokenizer, None) if params and own_init else cls()
    except (Exception, SystemExit) as e:  # noqa: BLE001 - the user's constructor
        text = str(e).strip()
        raise UserError(f"AgentExecutor() raised {type(e).__name__}"
                        + (f": {text.splitlines()[0]}" if text else "")) from None
    tools = {"tool_format": tool_format} if tool_format else {}  # (a file's own bind() may predate the argument)
    executor = executor.bind(max_steps=max_steps, max_length=max_length, llm_engine=llm_engine,
                             hf_tokenizer=tokenizer, step_timeout=step_timeout, **tools)
    bind_environment(executor, tool_format)  # an Environment class given where an AgentInstance class goes
    return executor


def _failed(prompt: Prompt, kind: str, text: str) -> Episode:
    return Episode(prompt_ids=list(prompt.token_ids), finish=FINISH_FAILED, error=f"{kind}: {text}")


def _isolate(executor: AgentExecutorBase, agent_path: str, workers: int, timeout: float) -> list[str]:
    """Move the file's own code into worker processes where it can live there: AgentInstances (the keys to
    release afterwards), or an OpenAI executor's `run_agent`. A tool agent's instances stay here
    (`isolate_instances = False`); its tools run in worker processes."""
    from rlhfkit.agents import isolation
    from rlhfkit.agents.openai_endpoint import OpenAIAgentExecutor

    if workers <= 0:
        return []
    if isinstance(executor, OpenAIAgentExecutor):
        return isolation.isolate_run_agent(executor, agent_path, workers, timeout)
    environment = getattr(executor, "environment", None)  # set by bind_environment
    if environment is not None:  # an Environment: it goes to the workers, its adapter (it holds the tokenizer) not
        executor.step_timeout = None  # the workers time calls out (and kill what hangs)
        return environment.isolate(agent_path, workers, timeout)
    if executor.agent_instance_cls is not None and getattr(executor, "isolate_instances", True):
        return isolation.isolate(executor, agent_path, workers, timeout)
    return []


async def _episode(executor: AgentExecutorBase, llm: BatchingGenerator, tokenizer: Any, request: dict[str, Any],
                   max_length: int) -> Episode:
    """One request's episode through the file's `execute`, in whichever form it is written; what the agent's code
    does wrong (raises, returns the wrong type) is a failed episode, what the engine or the run does wrong is not."""
    prompt = Prompt(request["prompt"], request["prompt_ids"])
    try:
        if not takes_engine(executor):  # OpenRLHF's example form: execute(prompt, label, sampling_params)
            out = await executor.execute(prompt, request.get("label"), dict(llm.sampling))
        else:  # OpenRLHF 0.11's: it drives a vLLM-shaped engine of its own episode
            engine = OpenRLHFEngine(llm, tokenizer, max_length)
            params = SamplingParams(llm.sampling, max_tokens=max_length, logprobs=1)
            out = await executor.execute(prompt, request.get("label"), params, max_length, tokenizer, engine)
            out = out if isinstance(out, Episode) else episode_from_dict(out, engine, max_length)
        if isinstance(out, Episode):
            return out
        return _failed(prompt, "bad_output", f"execute returned {type(out).__name__}; return what "
                                             "super().execute(...) returns")
    except AgentFailure as failure:  # e.g. a malformed dict from OpenRLHF 0.11's execute
        return _failed(prompt, failure.kind, str(failure))
    except (UserError, LoopBlocked):
        raise
    except Exception as e:  # noqa: BLE001 - an execute override raised: its episode fails, unless the engine did
        if llm.engine_error is not None:
            raise
        text = str(e).strip()
        return _failed(prompt, "exception", f"execute raised {type(e).__name__}"
                                            + (f": {text.splitlines()[0]}" if text else ""))


def run_episodes(engine_generate: Callable[..., list], tokenizer: Any, agent_path: str,
                 requests: Sequence[dict[str, Any]], *, max_steps: int, max_length: int, seed: int | None = None,
                 step_timeout: float | None = None, agent_workers: int = 0, tool_format: str | None = None,
                 image_reader: Any = None, **sampling: Any) -> list[dict[str, Any]]:
    """One episode per request {"prompt": text, "prompt_ids": [...], "label": ...}, all at once; plain dicts
    (Episode fields plus "truncated") in request order.

    The agent's code costs its own episode, never the run: an AgentInstance that raises, returns the wrong types
    or NaN, or whose reset/step takes longer than `step_timeout` seconds ends its episode as failed (kind
    exception, bad_output, non_finite, timeout); so does an `execute` override that raises or returns the wrong
    type. With `agent_workers` > 0 the AgentInstances (or an OpenAI executor's `run_agent`) run in that many worker
    processes (rlhfkit.agents.isolation), where a crash or a blocking call past `step_timeout` costs the episode too.
    Code that blocks the episodes' event loop here (a blocking `execute`) for `step_timeout` fails the episodes not
    finished by then (rlhfkit.agents.watchdog). `tool_format`: --tool_format, for tool agents. Image prompts
    (a request's "images") and image feedback need `image_reader` (the run's `RecordImages`); each episode dict
    then carries "images", every image of its context merged (None without)."""
    timeout = step_timeout or 60.0
    cls = load_agent_executor(agent_path, timeout)
    llm = BatchingGenerator(engine_generate, sampling, seed)
    llm.images = EpisodeImages(image_reader)
    try:
        executor = make_executor(cls, max_steps, max_length, llm, tokenizer, step_timeout, tool_format)
    except UserError as e:
        raise UserError(f"agent {agent_path}: {e}") from None
    keys = _isolate(executor, agent_path, agent_workers, timeout)
    done: dict[int, Episode] = {}

    async def one(i: int, request: dict[str, Any]) -> None:
        EPISODE_INDEX.set(i)  # this episode's task (and the tasks it starts) only
        llm.images.start(i, request.get("images"))
        try:
            done[i] = await _episode(executor, llm, tokenizer, request, max_length)
        finally:
            llm.episode_finished()

    async def run_all() -> None:
        llm.active = len(requests)
        await asyncio.gather(*[one(i, r) for i, r in enumerate(requests)])

    llm.watch = LoopWatch(timeout)
    try:
        llm.watch.run(run_all())
    except UserError:
        raise
    except LoopBlocked as e:  # the episodes not finished by then fail; the stuck code stays in its daemon thread
        for i, request in enumerate(requests):
            done.setdefault(i, _failed(Prompt(request["prompt"], request["prompt_ids"]), "timeout", str(e)))
    except Exception as e:  # noqa: BLE001 - the engine failed under the episodes; say where
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise UserError(f"agent {agent_path}: an episode raised {type(e).__name__}: {first}") from e
    finally:
        if keys:
            from rlhfkit.agents.isolation import release

            release(agent_path, agent_workers, timeout, keys)
    return [{**asdict(done[i]), "truncated": done[i].truncated, "batch_sizes": llm.batch_sizes,
             "images": llm.images.of(i),
             "versions": token_versions(done[i].prompt_ids, done[i].response_ids, done[i].action_mask,
                                        llm.traces.get(i, []))} for i in range(len(requests))]


def _count_non_finite(episode: dict[str, Any]) -> dict[str, Any]:
    """A finished episode whose reward or score is NaN / inf (e.g. what an OpenAI executor's run_agent returned) is a
    failed one (kind non_finite): it gets the fallback and counts under --max_reward_failure_ratio."""
    if episode["finish"] == FINISH_FAILED:
        return episode
    values = (episode["reward"], episode["reward"] if episode["score"] is None else episode["score"])
    if all(math.isfinite(float(v)) for v in values):
        return episode
    return {**episode, "finish": FINISH_FAILED,
            "error": f"non_finite: the episode's reward {values[0]} / score {values[1]} is not finite"}


def episodes_to_samples(episodes: Sequence[dict[str, Any]], fallback: float = 0.0, max_failure_ratio: float = 1.0,
                        where: str = "agent", prompts: Sequence[str] | None = None) -> tuple[list[Any], dict[str, Any]]:
    """The RL loop's view of finished episodes: SampledSequences (with their action masks) and the reward
    output ({"rewards", "scores", "extra_logs", "metrics"}) with the per-episode metrics under agent/. A failed
    episode keeps its tokens and gets `fallback` as reward and score; more than `max_failure_ratio` of them failed
    (any, with 0) is a UserError naming the agent, the first failure and its prompt."""
    import torch

    from rlhfkit.rollout.engine import FINISH_LENGTH, FINISH_STOP, SampledSequence

    episodes = [_count_non_finite(e) for e in episodes]
    samples = [SampledSequence(list(e["prompt_ids"]), list(e["response_ids"]), list(e["logprobs"]),
                               FINISH_LENGTH if e["truncated"] else FINISH_STOP, list(e["action_mask"]),
                               versions=e.get("versions"), images=e.get("images"))
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
