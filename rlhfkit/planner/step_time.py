"""Step-time estimate of `--dry_run` for the offline trainers (sft, rm, dpo, kto) on CPU: the work of one optimizer
step on one rank (matmul FLOPs, attention FLOPs, element-wise activation elements) at the machine's measured rates,
plus a fixed per-step overhead and, at world > 1, the sharding traffic.

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

Element-wise work (norms, activations, residual adds, the log-softmax over the vocabulary) is counted as h + i
elements per token and layer plus V logits, 3 times for a trained pass: on CPU it is bound by memory, not FLOPs.

The rates and overhead below are fit on `bench/cost_curves.py`'s CPU points (bench/results/cost_curves*.md show
the prediction against every measured point), once per fp32 GEMM kernel the linear layers can run on: MKL (PyTorch's
`F.linear`) and oneDNN (where rlhfkit.models.cpu_gemm routes them when its probe finds oneDNN faster). On the
machine a run plans on, each term follows its probe there against the fit machine's (`rlhfkit/planner/cpu_probe.py`,
`on_this_machine`), the matmul term at the GEMM rate measured at the run's thread count (`matmul_rate_from`).
Not estimated: the RL trainers (their step is mostly generation, which is bound by memory bandwidth, not FLOPs)
and GPUs (no rate measured here yet).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from rlhfkit.config.kinds import OfflineConfig, TrainConfig, WithReference
from rlhfkit.config.rl import PPOConfig
from rlhfkit.planner.cpu_probe import CpuProbe
from rlhfkit.planner.memory import ModelShape, read_model_shape


@dataclass(frozen=True)
class CpuRates:
    """Per-thread rates of one CPU fp32 GEMM kernel's runs: step CPU seconds = matmul FLOPs / matmul + attention
    FLOPs / attention + elements x seconds_per_element + overhead_s, fit by least squares (relative error) on the
    world-1 one-thread SFT and DPO points of bench/cost_curves.py (bench/results/cost_curves.md shows every point)."""

    kernel: str  # "aten" (F.linear: MKL's sgemm) or "onednn" (rlhfkit.models.cpu_gemm's routing)
    matmul: float  # FLOP/s of the linear layers
    attention: float  # FLOP/s of torch's CPU scaled_dot_product_attention (its own kernel whatever the linears use)
    seconds_per_element: float  # element-wise work (norms, SwiGLU, residual adds, log-softmax): memory-bound
    overhead_s: float  # per step
    # what a second torch thread adds to a process's speed, as a fraction of the first
    extra_thread_efficiency: float
    # the probes of rlhfkit/planner/cpu_probe.py on the fit's machine at one thread (None: not recorded there); each
    # term runs at its rate times what its probe measures on another machine against this (`on_this_machine`)
    reference: CpuProbe | None = None
    # The per-step cost of a data-parallel world over gloo on CPU: the ZeRO-3 / FSDP2 all-gathers and
    # reduce-scatters move every parameter about 3 times a step (forward gather, backward gather, gradient
    # reduce-scatter) at this rate, fp32 bytes; scaled like the element-wise term (memory-bound). Rough: the CPU
    # time per step the bench's world-2 points (25M model, SFT and DPO) spent beyond their compute.
    gloo_bytes_per_s: float = 1.0e9


# Linears on MKL (PyTorch's F.linear): fit 2026-11-29 on the 2-core AMD EPYC Zen 3 (AVX2, no AVX-512; torch 2.13.0+cpu,
# fp32, one torch thread): two runs of bench/cost_curves.py 25 minutes apart (tiny, 25M and 135M-shaped Llamas at 128
# to 8,192 tokens; 48 one-thread SFT and DPO points, each normalised by its run's probes to `reference`, their
# geometric mean), the worst within 27% of its CPU time (bench/results/cost_curves_zen3.md and
# cost_curves_zen3_first.md). The models' products run at 0.94x a 1024^3 product's rate, attention at 32 GFLOP/s.
# A second thread adds 0.6x to the terms other than the matmuls (which take the two-thread GEMM probe's rate): the
# two runs disagree (their two-thread steps ran at 1.6-1.7x and 2.0-2.4x their one-thread speed), 0.6 sits between.
# The Zen 5 fit before it (bench/results/cost_curves_mkl.md: 91 and 51 GFLOP/s, 3.8 ns, 1 ms) put this machine's
# steps up to 41% short. Four world-2 points a run (ZeRO-3 and FSDP2, 2 ranks on 2 cores) spent 0.40-0.96 s a step
# beyond compute: 0.29-0.69 GB/s of parameter traffic.
MKL = CpuRates("aten", 81.4e9, 32.3e9, 7.0e-9, 0.007, 0.6, reference=CpuProbe(86.2e9, 30.8e9, 2.02, 3.82),
               gloo_bytes_per_s=0.45e9)
# The fit with the linears on oneDNN (rlhfkit.models.cpu_gemm, the default where its probe finds it faster),
# 2026-11-28 on the Zen 5 machine (AVX-512), quiet (load 1.0-1.5): 19 points, 18 within 25% of their CPU time, the
# worst 28% (bench/results/cost_curves.md). That machine's probes were not recorded (no `reference`): only the matmul
# term follows the machine a run is on, at the GEMM rate measured there. The matmuls ran at ~1.8x MKL's rate on it;
# the fit puts more of the rest in a fixed per-step cost (28 ms: the tiny model's step at 128 tokens got slower,
# 0.029 -> 0.041 s, with ~10 us more per oneDNN call and the Python autograd function of each linear) and less in
# the element-wise term. Two threads: four points at 1.92-2.06x their one-thread estimate's speed (oneDNN's two-thread
# GEMM rate is 2x its one-thread rate).
# World 2: 0.8-1.0 GB/s of parameter traffic under ZeRO-3 and 1.9-2.1 under FSDP2; one rate for both, ZeRO-3's side.
ONEDNN = CpuRates("onednn", 168e9, 39e9, 1.0e-9, 0.028, 0.95, gloo_bytes_per_s=1.0e9)


def cpu_rates(onednn: bool) -> CpuRates:
    """The rates of the kernel a run's linear layers use (`rlhfkit.models.cpu_gemm.onednn_faster()`)."""
    return ONEDNN if onednn else MKL


def on_this_machine(rates: CpuRates, probe: CpuProbe | None) -> CpuRates:
    """`rates` with each term scaled by what its probe measured here at one thread (`probe`) against the fit's
    machine (`rates.reference`); unchanged where either is missing."""
    ref = rates.reference
    if ref is None or probe is None:
        return rates
    return replace(rates, matmul=rates.matmul * probe.gemm / ref.gemm,
                   attention=rates.attention * probe.attention / ref.attention,
                   seconds_per_element=rates.seconds_per_element * probe.element_ns / ref.element_ns,
                   overhead_s=rates.overhead_s * probe.op_us / ref.op_us,
                   gloo_bytes_per_s=rates.gloo_bytes_per_s * ref.element_ns / probe.element_ns)


def matmul_rate_from(rates: CpuRates, gemm: float | None) -> float | None:
    """The matmul term's FLOP/s from `gemm`, the 1024^3 product's rate measured at the run's thread count: the fit's
    rate scaled by it against the fit machine's (the models' smaller products run below a 1024^3 product's rate),
    or `gemm` itself where the fit recorded no reference; None where nothing was measured."""
    if gemm is None:
        return None
    return rates.matmul * gemm / rates.reference.gemm if rates.reference else gemm


@dataclass(frozen=True)
class Work:
    """What a step computes: matmul and attention FLOPs, and element-wise activation elements."""

    matmul: float = 0.0
    attention: float = 0.0
    elements: float = 0.0

    def __add__(self, other: Work) -> Work:
        return Work(self.matmul + other.matmul, self.attention + other.attention, self.elements + other.elements)

    def times(self, k: float) -> Work:
        return Work(self.matmul * k, self.attention * k, self.elements * k)

    @property
    def flops(self) -> float:
        return self.matmul + self.attention


@dataclass(frozen=True)
class StepTime:
    work: Work  # one optimizer step on one rank
    seconds: float
    threads: int
    overhead: float  # seconds per step on top of the work (fixed + communication)
    tokens: int  # trained tokens per step on one rank
    rates: CpuRates
    matmul_rate: float | None = None  # the measured FLOP/s the matmul term used (None: the fit's)


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


def token_elements(shape: ModelShape, lm_head: bool = True) -> int:
    """Element-wise activation elements a token makes in a forward: h + i per layer, and the logits (V) or one
    value."""
    return shape.num_layers * (shape.hidden_size + shape.intermediate_size) + (shape.vocab_size if lm_head else 1)


def forward_work(shape: ModelShape, rows: int, seq: int, lm_head: bool = True) -> Work:
    """One forward pass over `rows` rows of `seq` tokens."""
    tokens = rows * seq
    return Work(2.0 * matmul_weights(shape, lm_head) * tokens, attention_flops(shape, rows, seq),
                float(token_elements(shape, lm_head) * tokens))


def train_work(shape: ModelShape, rows: int, seq: int, lm_head: bool = True) -> Work:
    """Forward and backward: 3 forwards."""
    return forward_work(shape, rows, seq, lm_head).times(3)


def offline_step_work(trainer: str, shape: ModelShape, rows: int, seq: int, ref: ModelShape | None) -> Work:
    """The work of one step on one rank holding `rows` samples (sft) or pairs (rm, dpo, kto) of `seq` tokens; `ref`:
    the frozen reference of dpo/kto (None: reference-free losses)."""
    if trainer == "sft":
        return train_work(shape, rows, seq)
    if trainer == "rm":
        return train_work(shape, 2 * rows, seq, lm_head=False)
    policy = train_work(shape, 2 * rows, seq)
    return policy + (forward_work(ref, 2 * rows, seq) if ref is not None else Work())


def thread_speedup(threads: int, rates: CpuRates) -> float:
    """How much faster a process with `threads` torch threads computes than with one."""
    return 1 + rates.extra_thread_efficiency * (max(threads, 1) - 1)


def cpu_step_time(work: Work, tokens: int, threads: int, rates: CpuRates, params: int = 0,
                  world: int = 1, matmul_rate: float | None = None) -> StepTime:
    """Seconds of a step of `work` on one rank at `rates`: the compute terms sped up by `threads`, the fixed
    overhead, and with `world` > 1 the gloo traffic of sharding `params` fp32 parameters. `matmul_rate`: this
    machine's measured FLOP/s of the linears' kernel at `threads` (`cpu_gemm.gemm_rate`), in place of the fit's
    per-thread rate and thread speed-up for the matmul term."""
    speedup = thread_speedup(threads, rates)
    matmul = work.matmul / matmul_rate if matmul_rate else work.matmul / rates.matmul / speedup
    rest = (work.attention / rates.attention + work.elements * rates.seconds_per_element) / speedup
    overhead = rates.overhead_s + (3 * 4 * params / rates.gloo_bytes_per_s if world > 1 else 0.0)
    return StepTime(work, matmul + rest + overhead, threads, overhead, tokens, rates, matmul_rate)


def offline_estimate(cfg: OfflineConfig, trainer: str, world: int, threads: int, rates: CpuRates,
                     matmul_rate: float | None = None) -> StepTime:
    """The CPU step time of an offline trainer's config: `--train_batch_size` rows split over `world` ranks, each
    row `--max_len` tokens long."""
    shape = read_model_shape(cfg.model.pretrain or "", "--pretrain")
    ref = None
    if isinstance(cfg, WithReference):
        ref = read_model_shape(cfg.reference.ref_pretrain, "--ref_pretrain") if cfg.reference.ref_pretrain else shape
    rows = max(cfg.strategy.train_batch_size // max(world, 1), 1)
    seq = cfg.data.max_len
    work = offline_step_work(trainer, shape, rows, seq, ref)
    tokens = rows * seq * (1 if trainer == "sft" else 2)
    return cpu_step_time(work, tokens, threads, rates, shape.params(trainer != "rm"), world, matmul_rate)


def describe(cfg: TrainConfig, trainer: str, kind: str, world: int, threads: int) -> str | None:
    """The `step time` line of --dry_run; None where nothing is estimated (RL trainers: generation dominates their
    step; GPUs: no rate measured yet). The rates are those of the kernel the run's linear layers will use: oneDNN
    where rlhfkit.models.cpu_gemm's probe (at this process's thread count, `RLHFKIT_CPU_GEMM` first) finds it
    faster, as load_causal_lm will decide, else MKL's; each scaled to this machine by its probe
    (`on_this_machine`, `matmul_rate_from`: the fit's constants came from another CPU)."""
    if isinstance(cfg, PPOConfig) or kind != "cpu":
        return None
    from rlhfkit.models.cpu_gemm import gemm_rate, onednn_faster
    from rlhfkit.planner.cpu_probe import measure_one_thread

    fit = cpu_rates(onednn_faster())
    gemm = gemm_rate(fit.kernel)
    rates = on_this_machine(fit, measure_one_thread(fit.kernel) if fit.reference else None)
    st = offline_estimate(cfg, trainer, world, threads, rates, matmul_rate_from(fit, gemm))
    return (f"step time: about {st.seconds:.3g} s per optimizer step on this CPU ({st.tokens} tokens per rank at "
            f"--max_len {cfg.data.max_len}, {st.work.flops / 1e9:.3g} GFLOP, {threads} thread"
            f"{'s' if threads != 1 else ''}, linears on {'oneDNN' if st.rates.kernel == 'onednn' else 'MKL'}"
            f"{_matmul_words(st.matmul_rate, gemm, fit.reference is not None)}"
            f"{f', {st.overhead:.2g} s of gloo traffic' if world > 1 else ''}); shorter rows take less")


def _matmul_words(rate: float | None, gemm: float | None, scaled: bool) -> str:
    """How the line names the matmul rate: scaled from the GEMM probe, the probe's own, or none measured."""
    if rate is None or gemm is None:
        return ""
    if scaled:
        return f" at {rate / 1e9:.0f} GFLOP/s (a 1024^3 product: {gemm / 1e9:.0f} measured here)"
    return f" at a measured {rate / 1e9:.0f} GFLOP/s"
