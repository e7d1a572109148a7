"""The rollout engines' rows of an RL `--dry_run` plan (`rlhfkit/planner/plan.py`): what each engine holds per
device, and where.

- The Transformers engine of the single-process `train_ppo` loads its own copy of the policy
  (`HFRolloutEngine.from_spec`) and the actor's weights are copied into it after every step
  (`rlhfkit/rl/weight_sync.py: LocalWeightSync`): a weights row and a KV cache row.
- The Transformers engine of a `train_ppo_ray` run either runs as an engine actor of its own (its own process and
  copy of the weights, synced after every step) or, where `rlhfkit.config.shared_engine.run_shares_actor_weights`
  says so (the rule the runtime uses), inside the actor's process on the actor's own module
  (`rlhfkit/rl/actor_engine.py`): then the plan's member is `IN_ACTOR` and it has no weights row and no process of
  its own, only its KV cache, held by the actor's process while it generates.
- vLLM on CPU: its own copy of the weights and a CPU KV cache sized as `rlhfkit/rollout/vllm_engine.py` sizes it;
  vLLM on GPU: its share of `--vllm_gpu_memory_utilization`.
"""

from __future__ import annotations

import os

from rlhfkit.config.rl import PPOConfig, samples_per_rollout
from rlhfkit.config.rl_specs import HF_ENGINE_MIN_BATCH, generate_batch
from rlhfkit.config.shared_engine import run_shares_actor_weights
from rlhfkit.planner import memory as mem
from rlhfkit.planner.rows import Devices, Pool, Row

#: The plan member of a Transformers engine that runs inside the actor's process (no process, no weights of its own).
IN_ACTOR = "hf_engine (in actor)"


def engine_member(cfg: PPOConfig, member: str) -> str:
    """The plan member for placement member `member` of a `train_ppo_ray` run: `IN_ACTOR` for a Transformers engine
    that shares the actor's weights (the runtime's rule), else `member` itself."""
    return IN_ACTOR if member == "hf_engine" and run_shares_actor_weights(cfg) else member


def max_sequence(cfg: PPOConfig, shape: mem.ModelShape) -> int:
    """The longest sequence an engine caches: prompt + generation + 1, at most the model's positions."""
    max_len = cfg.data.prompt_max_len + cfg.data.generate_max_len + 1
    return min(max_len, int(shape.max_position_embeddings)) if shape.max_position_embeddings else max_len


def hf_kv_cache(cfg: PPOConfig, shape: mem.ModelShape) -> tuple[float, str]:
    """Bytes (and the row's note) of the Transformers engine's KV cache: the rows it generates at once (a rollout
    batch, at most max(--micro_rollout_batch_size, HF_ENGINE_MIN_BATCH)) x the longest sequence."""
    rows = min(samples_per_rollout(cfg), max(cfg.rollout.micro_rollout_batch_size, HF_ENGINE_MIN_BATCH))
    max_len = max_sequence(cfg, shape)
    return mem.kv_bytes_per_token(shape, cfg.model.bf16) * rows * max_len, f"{rows} x {max_len} tokens"


def engine_rows(cfg: PPOConfig, shape: mem.ModelShape, devices: Devices, name: str, pool: Pool) -> list[Row]:
    """The rows of engine member `name` (vllm, hf_engine or IN_ACTOR) on one device of `pool`."""
    if name == IN_ACTOR:
        kv, note = hf_kv_cache(cfg, shape)
        note += "; generates on the actor's own weights (no copy)"
        if pool.turns:  # --deepspeed_enable_sleep: the actor's states are loaded while it generates
            return [Row("actor", "KV cache (engine in actor)", "train", kv, transient=True, note=note)]
        return [Row("actor", "KV cache (engine in actor)", "generate", kv, note=note)]
    weights = shape.params() * (2 if cfg.model.bf16 else 4)
    if name == "hf_engine":
        kv, note = hf_kv_cache(cfg, shape)
        return [Row(name, "weights", "resident", weights, note="own copy of the policy, synced after every step"),
                Row(name, "KV cache", "generate", kv, note=note)]
    if devices.kind == "cpu":  # the user's VLLM_CPU_KVCACHE_SPACE wins; else sized as rollout/vllm_engine.py does
        max_len, space = max_sequence(cfg, shape), os.environ.get("VLLM_CPU_KVCACHE_SPACE")
        g = mem.vllm_cpu_concurrent(generate_batch(cfg))
        per_token = mem.kv_bytes_per_token(shape, cfg.model.bf16)
        kv = float(space) * mem.GIB if space else mem.vllm_cpu_kv_cache_bytes(per_token, g, max_len)
        note = f"VLLM_CPU_KVCACHE_SPACE={space} GiB" if space else f"sized for {g} x {max_len} tokens"
        return [Row(name, "weights", "resident", weights, note="own copy of the policy"),
                Row(name, "KV cache", "generate", kv, note=note)]
    return _vllm_gpu_rows(cfg, shape, devices, pool)


def _vllm_gpu_rows(cfg: PPOConfig, shape: mem.ModelShape, devices: Devices, pool: Pool) -> list[Row]:
    r, max_len = cfg.rollout, max_sequence(cfg, shape)
    tp = r.vllm_tensor_parallel_size
    budget = mem.vllm_budget(shape, devices.memory, r.vllm_gpu_memory_utilization, tp, max_len)
    phase = "generate" if r.vllm_enable_sleep else "resident"
    if budget.sequences < 1:
        need = max_len * mem.kv_bytes_per_token(shape, True, tp)
        pool.checks.append(f"vLLM: {mem.gib(budget.kv_cache)} of KV cache per device holds {budget.tokens} tokens, "
                           f"less than one {max_len}-token sequence ({mem.gib(need)}); vLLM will not start")
    return [Row("vllm", "weights", phase, budget.weights, note=f"bf16 / TP {tp}"),
            Row("vllm", "KV cache + workspace", phase, budget.reserved - budget.weights,
                note=f"{budget.blocks} blocks of {mem.VLLM_BLOCK_SIZE} = {budget.tokens} tokens, "
                     f"{budget.sequences} x {max_len}-token sequences")]
