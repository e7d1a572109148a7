"""fp32 linear layers on CPU through oneDNN where it multiplies faster than the BLAS PyTorch calls by default.

PyTorch runs an fp32 `F.linear` on CPU through MKL's sgemm. On AMD CPUs MKL does not use its AVX-512 kernels:
measured on the 2-core AMD EPYC (Zen 5) CI machine, torch 2.13, one thread, MKL gives 90-112 GFLOP/s on the bench
models' shapes where oneDNN (bundled in the same wheel, `torch.ops.mkldnn._linear_pointwise`) gives 230-250 for
the forward and the input gradient and 165-225 for the weight gradient (`bench/machine_limit.py`). Both compute in
fp32 with fp32 accumulation (errors against float64 of the same order, ~1e-6 relative). On a 2-core Zen 3 (AVX2
only) it is the other way round: MKL 176-182 GFLOP/s at two threads, oneDNN 14-26% slower, and nothing is routed.

`use_fast_cpu_linears(model)` routes a model's `nn.Linear` layers through an autograd function whose forward and
two backward products all run on oneDNN, when a probe at the process's thread count finds oneDNN faster (on an
Intel CPU, where MKL is fast, it usually does not, and nothing changes). Each call falls back to `F.linear` for
anything else: a GPU tensor, another dtype, autocast, a DTensor, or a product too small for oneDNN's ~10 us call
overhead to pay (M x K x N < 2^21). `RLHFKIT_CPU_GEMM=aten` turns the routing off, `=onednn` forces it (tests,
benches).

The probe runs once per machine (CPU model, torch build, thread count) and its decision is recorded in
`<cache_root()>/cpu-gemm/choices.json`; delete the file to measure again. The two kernels round differently, so a
run resumed in a new process, the ranks of one torchrun job and two runs compared bit for bit must multiply on the
same one, and a probe repeated in each process now and then picked the slower kernel on the 2-core Zen 3 (a resumed
run then drifted from the uninterrupted one by 1.7e-4).
"""

from __future__ import annotations

import fcntl
import functools
import json
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from rlhfkit.cache import cache_root, write_atomically

ENV = "RLHFKIT_CPU_GEMM"
CHOICES = ("auto", "onednn", "aten")
MIN_PRODUCT = 1 << 21  # M*K*N below which MKL's lower call overhead wins (measured: 16x128x344 MKL 17 us, oneDNN 20)
PROBE_SHAPE = (1024, 1024, 1024)  # M, K, N: the size of the bench models' products, ~2 GFLOP (12 ms at 2 threads)
PROBE_ROUNDS = 7  # once per machine (0.4 s at one thread): the best of 7 keeps a slow burst from deciding
RATE_CALLS = 8  # gemm_rate's timed calls
_choice: dict[int, bool] = {}  # torch thread count -> oneDNN measured faster
_seconds: dict[int, dict[str, float]] = {}  # torch thread count -> kernel -> best CPU seconds of a probe product
_rates: dict[tuple[int, str], float | None] = {}  # (torch thread count, kernel) -> gemm_rate


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _cpu_seconds(fn: Any) -> float:
    """The process CPU time of one call: unlike wall-clock, it does not count the time the process waited for a
    core, so a loaded machine cannot flip the decision (and with it the numerics) between the processes of one run."""
    start = time.process_time()
    fn()
    return time.process_time() - start


@functools.cache
def _onednn_works() -> bool:
    """Whether this build's oneDNN has the fp32 linear `_onednn_linear` calls (tried once)."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    try:
        _onednn_linear(torch.ones(2, 2), torch.ones(2, 2), None)
    except RuntimeError:  # a build whose oneDNN lacks the fp32 kernel
        return False
    return True


def _probe_kernels() -> dict[str, Any]:
    """kernel name -> one PROBE_SHAPE product on it ("onednn" only where this build has its fp32 linear)."""
    m, k, n = PROBE_SHAPE
    x, w = torch.randn(m, k), torch.randn(n, k)
    kernels: dict[str, Any] = {"aten": lambda: F.linear(x, w)}
    if _onednn_works():
        kernels["onednn"] = lambda: _onednn_linear(x, w, None)
    return kernels


def _time_kernels() -> dict[str, float]:
    """The best CPU seconds of one PROBE_SHAPE product on each kernel, in PROBE_ROUNDS alternating rounds of one
    call each after a warm-up call each: alternating keeps a burst of load or a frequency change from landing on one
    kernel only."""
    kernels = _probe_kernels()
    for fn in kernels.values():
        fn()
    best = dict.fromkeys(kernels, float("inf"))
    for _ in range(PROBE_ROUNDS):
        for name, fn in kernels.items():
            best[name] = min(best[name], _cpu_seconds(fn))
    return best


def kernel_seconds() -> dict[str, float]:
    """`_time_kernels` at this process's torch thread count, measured once per thread count."""
    threads = torch.get_num_threads()
    if threads not in _seconds:
        _seconds[threads] = _time_kernels()
    return _seconds[threads]


def _probe() -> bool:
    """Whether oneDNN's fp32 linear beats `F.linear` here by 10% or more, on one 1024^3 product (~0.4 s at one
    thread, ~0.2 s at two, `kernel_seconds`; once per machine, `_machine_choice`).

    The shape matters. On a 2-core Zen 3 (AVX2, no AVX-512) oneDNN is 14-26% slower than MKL on 1024^3 and on the
    bench models' products, but within +-5% of it on a 256x512x1024 product, where one process in four or so timed
    MKL slow enough to pick oneDNN, and that process's training step ran 25% slower."""
    seconds = kernel_seconds()
    return "onednn" in seconds and seconds["onednn"] < 0.9 * seconds["aten"]


def best_seconds(fn: Callable[[], object], calls: int) -> float:
    """The shortest wall-clock time of `calls` calls of `fn`, after one untimed warm-up call."""
    fn()
    best = float("inf")
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _measure_rate(kernel: str) -> float | None:
    kernels = _probe_kernels()
    if kernel not in kernels:
        return None
    m, k, n = PROBE_SHAPE
    return 2.0 * m * k * n / best_seconds(kernels[kernel], RATE_CALLS)


def gemm_rate(kernel: str) -> float | None:
    """FLOP/s of `kernel` ("aten" or "onednn") on a 1024^3 product at this process's torch thread count: the best
    wall-clock call of RATE_CALLS after a warm-up, i.e. the rate of a machine the process has to itself (the
    `--dry_run` step-time estimate's matmul rate; 0.1-0.2 s, once per thread count and kernel); None where this
    build has no such kernel. Not the probe's CPU times: at two threads on the 2-core Zen 3 one call's CPU time put
    MKL anywhere from 96 to 169 GFLOP/s from one process to the next."""
    key = (torch.get_num_threads(), kernel)
    if key not in _rates:
        _rates[key] = _measure_rate(kernel)
    return _rates[key]


def onednn_faster() -> bool:
    """The routing decision for this process's current torch thread count (`RLHFKIT_CPU_GEMM` first)."""
    setting = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if setting not in CHOICES:
        raise ValueError(f"{ENV}={setting!r}: expected one of {', '.join(CHOICES)}")
    if setting != "auto":
        return setting == "onednn"
    threads = torch.get_num_threads()
    if threads not in _choice:
        _choice[threads] = _machine_choice(threads) and _onednn_works()
    return _choice[threads]


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_key(threads: int) -> str:
    """What a recorded decision holds for: the CPU model, the torch build (it bundles both kernels), threads."""
    return f"{_cpu_model()} | torch {torch.__version__} | {threads} thread{'s' * (threads != 1)}"


def _read_choices(path: Path) -> dict[str, Any]:
    """The recorded decisions; none where the file is absent or damaged (then measured again and rewritten)."""
    try:
        choices = json.loads(path.read_text()) if path.is_file() else {}
    except ValueError:
        return {}
    return choices if isinstance(choices, dict) else {}


def _machine_choice(threads: int) -> bool:
    """This machine's recorded decision at `threads`; the first process to need it probes and records it, under a
    file lock so that processes starting together (the ranks of a job) wait for it instead of probing apart. Where
    the cache cannot be written, each process probes for itself, as before the record."""
    folder = cache_root() / "cpu-gemm"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / "lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            path, key = folder / "choices.json", machine_key(threads)
            choices = _read_choices(path)
            if not isinstance(choices.get(key), dict):
                choices[key] = {"onednn": _probe(), "cpu_seconds": kernel_seconds()}
                write_atomically(path, json.dumps(choices, indent=1, sort_keys=True) + "\n")
            return bool(choices[key].get("onednn"))
    except OSError:
        return _probe()


def kernel_for_workers() -> str:
    """This process's choice, "onednn" or "aten", for the `RLHFKIT_CPU_GEMM` of the processes it starts (a Ray
    run's roles and engines): one probe in the driver decides for the whole run, so two processes of one run cannot
    choose differently (the two kernels round differently, and a parity check between ranks or backends would see
    it) and no role pays a probe. A GPU machine never routes, whatever this says."""
    return "onednn" if onednn_faster() else "aten"


class _OneDnnLinear(torch.autograd.Function):
    """y = x W^T + b with the forward, dL/dx = g W and dL/dW = g^T x each one oneDNN call on 2-D views."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        ctx.save_for_backward(x2, weight)
        ctx.in_shape = x.shape
        ctx.has_bias = bias is not None
        return _onednn_linear(x2, weight, bias).reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x2, weight = ctx.saved_tensors
        g2 = grad.reshape(-1, weight.shape[0])
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = _onednn_linear(g2, weight.t(), None).reshape(ctx.in_shape)
        if ctx.needs_input_grad[1]:
            grad_w = _onednn_linear(g2.t(), x2.t(), None)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g2.sum(0)
        return grad_x, grad_w, grad_b


def _routable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.device.type == "cpu" and x.dtype == torch.float32 and weight.dtype == torch.float32
            and type(weight) in (torch.Tensor, nn.Parameter) and type(x) is torch.Tensor
            and weight.dim() == 2 and weight.is_contiguous() and x.shape[-1] == weight.shape[1]
            and x.numel() * weight.shape[0] >= MIN_PRODUCT and not torch.is_autocast_enabled("cpu"))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear`, through oneDNN when `_routable` says the call is an fp32 CPU product worth it."""
    if _routable(x, weight) and (bias is None or bias.dtype == torch.float32):
        return _OneDnnLinear.apply(x, weight, bias)
    return F.linear(x, weight, bias)


def _forward(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return linear(x, layer.weight, layer.bias)


def use_fast_cpu_linears(model: nn.Module) -> int:
    """Route `model`'s plain `nn.Linear` layers through `linear` when oneDNN is faster here; returns how many.
    A layer keeps its class, parameters and state dict: only its instance `forward` changes, so DeepSpeed, FSDP2,
    PEFT (which calls the base layer) and checkpoints see the same module. The forward is a `functools.partial` of a
    module-level function, not a bound method, so a routed model still pickles (`torch.save(model)`, Ray) and
    deep-copies onto its copy."""
    if not onednn_faster():
        return 0
    count = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.forward = functools.partial(_forward, module)  # type: ignore[method-assign]
            count += 1
    return count
