"""Step-time estimate of `--dry_run` for the offline trainers (sft, rm, dpo, kto) on CPU: the FLOPs of one optimizer
step on one rank divided by the machine's rate, plus a fixed per-step overhead.

FLOPs (Kaplan et al. 2020, "Scaling Laws for Neural Language Models", section 2.1; the 6N rule as in Hoffmann et
al. 2022, "Training Compute-Optimal Large Language Models", appendix F):
- a forward pass costs 2 FLOPs per weight of every matrix a token meets (the decoder layers' projections, the active
  experts of a mixture of experts, and the LM head: V x h even when tied to the embeddings; the embedding lookup is
  free), plus causal attention: QK^T and the weighted sum of V, 2 x 2 x s x d_q per token of a row of s tokens
  over all s positions, halved by the causal mask: 2 x s^2 x d_q per row and layer;
- a trained pass costs 3 forwards (backward: 2, for the gradients of activations and of weights): 6N per token.
Per step and rank: SFT trains its rows; DPO and KTO train their chosen and rejected rows (2 per pair) and run the
frozen reference forward on them; RM trains 2 rows per pair with a value head instead of the LM head. Every row is
taken full (`--max_len` tokens): an upper bound for shorter data, exact for packed data.

The rate and overhead below are fit on `bench/cost_curves.py`'s CPU points (bench/results/cost_curves.md shows the
prediction against every measured point). Not estimated: the RL trainers (their step is mostly generation, which is
bound by memory bandwidth, not FLOPs) and GPUs (no rate measured here yet).
"""

from __future__ import annotations

from dataclasses import dataclass

from rlhfkit.config.kinds import OfflineConfig, TrainConfig, WithReference
from rlhfkit.config.rl import PPOConfig
from rlhfkit.planner.memory import ModelShape, read_model_shape

# Measured 2026-11-27 on the CPU dev machine (x86_64, 2 cores, torch 2.13.0+cpu, fp32, one torch thread per process):
# the least-squares fit of step seconds = FLOPs / rate + overhead over the world-1 SFT and DPO points of
# bench/cost_curves.py (tiny, 25M and 135M-shaped Llamas, 128 to 8,192 tokens). See bench/results/cost_curves.md.
CPU_FLOPS_PER_THREAD = 60e9
CPU_STEP_OVERHEAD_S = 0.02
# What a second thread adds to a process's rate, as a fraction of the first (the same bench at 2 threads).
CPU_EXTRA_THREAD_EFFICIENCY = 0.5
# The per-step cost of a data-parallel world over gloo on CPU: the ZeRO-3 / FSDP2 all-gathers and reduce-scatters
# move every parameter about 3 times a step (forward gather, backward gather, gradient reduce-scatter) at this
# rate, fp32 bytes (the same bench at world 1 and 2).
CPU_GLOO_BYTES_PER_S = 1e9


@dataclass(frozen=True)
class StepTime:
    flops: float  # one optimizer step on one rank
    seconds: float
    rate: float  # FLOP/s used
    overhead: float  # seconds per step on top of the FLOPs (fixed + communication)
    tokens: int  # trained tokens per step on one rank


def matmul_weights(shape: ModelShape, lm_head: bool = True) -> int:
    """Weights one token multiplies through: each layer's projections (the active experts only), and the LM head
    (V x h) or a value head (h)."""
    h = shape.hidden_size
    attention = h * shape.num_heads * shape.head_dim * 2 + h * shape.kv_dim * 2
    if shape.num_experts:
        mlp = (shape.experts_per_token * 3 * h * shape.expert_intermediate_size + h * shape.num_experts
               + 3 * h * shape.shared_intermediate_size)
    else:
        mlp = 3 * h * shape.intermediate_size
    head = shape.vocab_size * h if lm_head else h
    return shape.num_layers * (attention + mlp) + head


def attention_flops(shape: ModelShape, rows: int, seq: int) -> float:
    """Forward FLOPs of causal attention scores and their weighted sum: 2 x s^2 x d_q per row and layer."""
    return 2.0 * shape.num_layers * rows * seq * seq * shape.num_heads * shape.head_dim


def forward_flops(shape: ModelShape, rows: int, seq: int, lm_head: bool = True) -> float:
    """One forward pass over `rows` rows of `seq` tokens."""
    return 2.0 * matmul_weights(shape, lm_head) * rows * seq + attention_flops(shape, rows, seq)


def train_flops(shape: ModelShape, rows: int, seq: int, lm_head: bool = True) -> float:
    """Forward and backward: 3 forwards."""
    return 3.0 * forward_flops(shape, rows, seq, lm_head)


def offline_step_flops(trainer: str, shape: ModelShape, rows: int, seq: int, ref: ModelShape | None) -> float:
    """FLOPs of one step on one rank holding `rows` samples (sft) or pairs (rm, dpo, kto) of `seq` tokens; `ref`:
    the frozen reference of dpo/kto (None: reference-free losses)."""
    if trainer == "sft":
        return train_flops(shape, rows, seq)
    if trainer == "rm":
        return train_flops(shape, 2 * rows, seq, lm_head=False)
    policy = train_flops(shape, 2 * rows, seq)
    return policy + (forward_flops(ref, 2 * rows, seq) if ref is not None else 0.0)


def cpu_rate(threads: int) -> float:
    """FLOP/s of one process with `threads` torch threads."""
    return CPU_FLOPS_PER_THREAD * (1 + CPU_EXTRA_THREAD_EFFICIENCY * (max(threads, 1) - 1))


def cpu_step_time(flops: float, tokens: int, threads: int, params: int = 0, world: int = 1) -> StepTime:
    """Seconds of a step of `flops` on one rank: compute at `cpu_rate(threads)`, the fixed overhead, and with
    `world` > 1 the gloo traffic of sharding `params` fp32 parameters."""
    rate = cpu_rate(threads)
    overhead = CPU_STEP_OVERHEAD_S + (3 * 4 * params / CPU_GLOO_BYTES_PER_S if world > 1 else 0.0)
    return StepTime(flops, flops / rate + overhead, rate, overhead, tokens)


def offline_estimate(cfg: OfflineConfig, trainer: str, world: int, threads: int) -> StepTime:
    """The CPU step time of an offline trainer's config: `--train_batch_size` rows split over `world` ranks, each
    row `--max_len` tokens long."""
    shape = read_model_shape(cfg.model.pretrain or "", "--pretrain")
    ref = None
    if isinstance(cfg, WithReference):
        ref = read_model_shape(cfg.reference.ref_pretrain, "--ref_pretrain") if cfg.reference.ref_pretrain else shape
    rows = max(cfg.strategy.train_batch_size // max(world, 1), 1)
    seq = cfg.data.max_len
    flops = offline_step_flops(trainer, shape, rows, seq, ref)
    tokens = rows * seq * (1 if trainer == "sft" else 2)
    return cpu_step_time(flops, tokens, threads, shape.params(trainer != "rm"), world)


def describe(cfg: TrainConfig, trainer: str, kind: str, world: int, threads: int) -> str | None:
    """The `step time` line of --dry_run; None where nothing is estimated (RL trainers: generation dominates their
    step; GPUs: no rate measured yet)."""
    if isinstance(cfg, PPOConfig) or kind != "cpu":
        return None
    st = offline_estimate(cfg, trainer, world, threads)
    return (f"step time: about {st.seconds:.3g} s per optimizer step on this CPU ({st.tokens} tokens per rank at "
            f"--max_len {cfg.data.max_len}, {st.flops / 1e9:.3g} GFLOP at {st.rate / 1e9:.0f} GFLOP/s with "
            f"{threads} thread{'s' if threads != 1 else ''}, + {st.overhead:.2g} s overhead); shorter rows take less")
