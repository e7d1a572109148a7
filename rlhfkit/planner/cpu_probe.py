"""Probes of this CPU for the `--dry_run` step-time estimate: one small timed kernel per term of the estimate.

The estimate's rates (`rlhfkit/planner/step_time.py`) are least-squares fits on one machine's measured training
steps. Another CPU runs each term at its own speed: the matmuls at its GEMM rate, attention at its
`scaled_dot_product_attention` rate, the element-wise work at its memory bandwidth, the per-step overhead at its
speed of dispatching small ops. So each term is scaled by what its probe measures here at one thread against what
it measured on the fit's machine (`CpuRates.reference`, `step_time.on_this_machine`), and the matmul term takes the
GEMM probe at the run's own thread count (`step_time.matmul_rate_from`):
- `gemm`: FLOP/s of the linears' kernel on a 1024^3 product (`rlhfkit.models.cpu_gemm.gemm_rate`);
- `attention`: FLOP/s of causal attention forward over 8 heads x 512 tokens x 64 (2 x s^2 x d_q FLOPs, the
  estimate's own count);
- `element_ns`: ns per element of SiLU x gate, a residual add and a row norm over 2^21 fp32 elements, into buffers
  made once;
- `op_us`: us per small op (an add of 16 elements), Python and dispatcher overhead.
Each is the best of a few timed calls after a warm-up (the rate of a machine the process has to itself), 0.1-0.2 s
besides the GEMM probe, measured once per process, kernel and thread count. On a shared VM one process's probes can
all come out up to 20% slow or fast together (the 2-core Zen 3: a 1024^3 product at 72-92 GFLOP/s from one process
to the next), and the estimate moves with them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

CALLS = 5
SMALL_OPS = 200
ATTENTION_SHAPE = (1, 8, 512, 64)  # rows, heads, tokens, head_dim
ELEMENT_SHAPE = (2048, 1024)  # 2^21 elements


@dataclass(frozen=True)
class CpuProbe:
    """What the probes measured on a machine (module docstring); `threads`: the torch thread count they ran at.
    Defined without importing torch: `rlhfkit.planner.step_time` keeps the fit machines' probes as constants."""

    gemm: float
    attention: float
    element_ns: float
    op_us: float
    threads: int = 1


def attention_rate() -> float:
    import torch
    import torch.nn.functional as F

    from rlhfkit.models.cpu_gemm import best_seconds

    rows, heads, tokens, head_dim = ATTENTION_SHAPE
    q, k, v = (torch.randn(ATTENTION_SHAPE) for _ in range(3))
    seconds = best_seconds(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), CALLS)
    return 2.0 * rows * tokens * tokens * heads * head_dim / seconds


def element_ns() -> float:
    import torch

    from rlhfkit.models.cpu_gemm import best_seconds

    x, gate = torch.randn(ELEMENT_SHAPE), torch.randn(ELEMENT_SHAPE)
    h, norm = torch.empty(ELEMENT_SHAPE), torch.empty(ELEMENT_SHAPE[0], 1)

    def chain() -> None:  # into buffers made once: a fresh 8 MB tensor a call would time the allocator's page faults
        torch.sigmoid(gate, out=h)
        h.mul_(gate).mul_(x).add_(x)
        torch.linalg.vector_norm(h, dim=-1, keepdim=True, out=norm)
        h.div_(norm)

    return best_seconds(chain, CALLS) / x.numel() * 1e9


def op_us() -> float:
    import torch

    from rlhfkit.models.cpu_gemm import best_seconds

    small = torch.zeros(16)

    def ops() -> None:
        y = small
        for _ in range(SMALL_OPS):
            y = y + 1

    return best_seconds(ops, CALLS) / SMALL_OPS * 1e6


@functools.cache
def _measure(kernel: str, threads: int) -> CpuProbe | None:
    import torch

    from rlhfkit.models.cpu_gemm import gemm_rate

    gemm = gemm_rate(kernel)
    if gemm is None:
        return None
    with torch.no_grad():
        return CpuProbe(gemm, attention_rate(), element_ns(), op_us(), threads)


def measure(kernel: str) -> CpuProbe | None:
    """This machine's probes at this process's torch thread count, the GEMM on `kernel` ("aten" or "onednn");
    None where this build has no such kernel (`cpu_gemm.gemm_rate`)."""
    import torch

    return _measure(kernel, torch.get_num_threads())


def measure_one_thread(kernel: str) -> CpuProbe | None:
    """`measure(kernel)` at one torch thread (the fits' references are one-thread figures), the process's thread
    count restored after."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return measure(kernel)
    finally:
        torch.set_num_threads(before)
