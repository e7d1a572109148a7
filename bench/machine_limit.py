"""The machine's own limit, measured, and each bench workload as a fraction of it.

Ratios to TRL say we are ahead of one peer; they do not say how far a step is from what the machine can do. This
module measures that anchor on this machine, in this session:

- the GEMM rate on the models' own matrix shapes: each linear layer of a bench model (the q/k/v/o projections, the
  MLP's gate/up/down and the LM head) as `F.linear` at the token counts the benches feed it, plus its two backward
  products (input gradient `g @ W`, weight gradient `g^T @ x`), at 1 and 2 threads, fp32 and (where the CPU has
  AVX512-BF16 or AMX) bf16. fp32 runs on each kernel the build has: "aten" (`F.linear` and `torch.matmul`,
  MKL's sgemm on x86: what PyTorch and TRL use) and "onednn" (the op rlhfkit.models.cpu_gemm routes rlhfkit's
  linear layers through where it is faster: on AMD CPUs MKL leaves its AVX-512 kernels unused and oneDNN is about
  2x faster). A model's rate is its FLOP-weighted rate over its shapes: the sum of the products' FLOPs over the sum
  of their measured times, so the time a step's matmuls would take if every one ran as fast as it does alone. The
  machine's fp32 rate, which every fraction divides by, takes each shape on its faster kernel (a per-layer choice
  of kernel, as rlhfkit's routing makes); each kernel's own rate is reported beside it. bf16 runs on aten only;
- the memory bandwidth: a large copy and a STREAM triad (`a = b + s * c`) on arrays far past the last-level cache.

A workload's fraction is `floor / step time`, where the floor is its model FLOPs (PaLM's counting, bench/gpu/flops.py:
6N per trained token plus 12 L d_attn T^2 per sequence, a forward alone a third of that) over the model's measured
rate; for decoding, each decode step's floor is the larger of its FLOPs over the forward rate at the decode batch
and its weight bytes over the bandwidth (a roofline). The FLOPs are the workload's arithmetic, not an
implementation's: a prompt shared by a DPO pair or a GRPO group counts once (`shared_prefix_flops`), as the math
needs it once.

    .venv/bin/python bench/machine_limit.py [--rounds 2] [--seconds 0.15] [--threads 1,2]

writes bench/results/machine_limit.json (the rates) and prints the table that bench/results/machine_limit.md records.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.append(str(Path(__file__).resolve().parent / "gpu"))  # flops.py; appended: its neighbours shadow nothing

from flops import ModelShape, train_flops  # noqa: E402, F401 (train_flops: re-exported for the bench scripts)

RESULTS = Path(__file__).resolve().parent / "results" / "machine_limit.json"
# SmolLM2-135M's shape (bench/real_model.py's model): measured as a shape only, no weights needed
SMOLLM2_135M = {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
                "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152}
# the token counts (rows of the activation matrix) the benches run: 128 a decode step of 128 sequences, 512 to
# 8192 a training micro-batch (16 rows of 32 to 512 tokens; 64 GRPO samples of ~50); the 135M LM head stops at
# 2048 (a 400 MB output); the tiny model's benches stay under 4096 tokens a micro-batch
TOKENS = {"tiny": (128, 512, 2048), "25m": (128, 512, 2048, 8192), "135m": (128, 512, 2048)}


# -- shapes and FLOPs ----------------------------------------------------------------------------------------------
def linear_shapes(config: dict[str, Any]) -> list[tuple[str, int, int, int]]:
    """(name, in features, out features, how many in the model) of every matmul a token goes through."""
    h, layers = config["hidden_size"], config["num_hidden_layers"]
    heads, kv = config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"]
    head_dim = config.get("head_dim") or h // heads
    inter = config["intermediate_size"]
    return [("q", h, heads * head_dim, layers), ("k", h, kv * head_dim, layers), ("v", h, kv * head_dim, layers),
            ("o", heads * head_dim, h, layers), ("gate", h, inter, layers), ("up", h, inter, layers),
            ("down", inter, h, layers), ("lm_head", h, config["vocab_size"], 1)]


def model_shape(config: dict[str, Any]) -> ModelShape:
    """PaLM's N (the parameters multiplied per token: the linear layers and the LM head; the input embedding is a
    lookup, norms are a rounding error) and the attention width."""
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return ModelShape(sum(k * n * c for _, k, n, c in linear_shapes(config)), config["num_hidden_layers"],
                      config["num_attention_heads"] * head_dim)


def shared_prefix_flops(shape: ModelShape, prompt: float, answers: Sequence[float], train: bool) -> float:
    """A prompt of `prompt` tokens followed by each of `answers` (a DPO pair, a GRPO group), the prompt computed
    once: 2N (forward) or 6N (forward and backward) per distinct token, and attention as PaLM counts it (12 L d T^2
    for a sequence of T, trained) with the prompt's own block once: T^2 = P^2 once plus 2PA + A^2 per answer.
    With one answer it is `train_flops(shape, [prompt + answer])` (or a third of it)."""
    tokens = prompt + sum(answers)
    square = prompt**2 + sum(2 * prompt * a + a**2 for a in answers)
    flops = 6 * shape.matmul_params * tokens + 12 * shape.layers * shape.attn_width * square
    return float(flops if train else flops / 3)


def config_of(model_dir: Path) -> dict[str, Any]:
    config: dict[str, Any] = json.loads((Path(model_dir) / "config.json").read_text())
    return config


# -- measuring -----------------------------------------------------------------------------------------------------
def best_time(fn: Callable[[], Any], seconds: float, threads: int = 1) -> float:
    """Seconds per call: the fastest of a few short chunks (a shared machine only ever slows a chunk down), each
    chunk's time the smaller of its wall-clock and its process CPU time over `threads` (the time on cores of its
    own: on a machine loaded past its cores the wall-clock of every chunk includes waits for a core)."""
    for _ in range(2):
        fn()
    best, start = float("inf"), time.perf_counter()
    while time.perf_counter() - start < seconds or best == float("inf"):
        t0, c0, n = time.perf_counter(), time.process_time(), 0
        while n < 2 or time.perf_counter() - t0 < seconds / 5:
            fn()
            n += 1
        wall, cpu = time.perf_counter() - t0, (time.process_time() - c0) / threads
        best = min(best, min(wall, cpu) / n)
    return best


def fp32_kernels() -> tuple[str, ...]:
    """The fp32 kernels this torch build has: "aten" (`F.linear` / `torch.matmul`: MKL's sgemm on x86) and, where
    its oneDNN has the fp32 linear, "onednn" (the op rlhfkit.models.cpu_gemm routes linear layers through)."""
    import torch

    onednn = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    return ("aten", "onednn") if onednn else ("aten",)


def _products(kernel: str, x: Any, w: Any, g: Any) -> list[Callable[[], Any]]:
    """The forward `x W^T`, the input gradient `g W` and the weight gradient `g^T x` on `kernel`, each as
    rlhfkit.models.cpu_gemm computes it (oneDNN) or as PyTorch's default linear and its backward do (aten)."""
    import torch
    import torch.nn.functional as F

    if kernel == "onednn":
        from rlhfkit.models.cpu_gemm import _onednn_linear

        return [lambda: _onednn_linear(x, w, None), lambda: _onednn_linear(g, w.t(), None),
                lambda: _onednn_linear(g.t(), x.t(), None)]
    return [lambda: F.linear(x, w), lambda: torch.matmul(g, w), lambda: torch.matmul(g.t(), x)]


def linear_times(m: int, k: int, n: int, dtype: Any, seconds: float, threads: int = 1,
                 kernel: str = "aten") -> tuple[float, float]:
    """(forward seconds, forward + both backward products seconds) of a linear layer with m tokens on `kernel`."""
    import torch

    x, w, g = (torch.randn(*s, dtype=dtype) for s in ((m, k), (n, k), (m, n)))
    fwd, dgrad, wgrad = (best_time(fn, seconds, threads) for fn in _products(kernel, x, w, g))
    return fwd, fwd + dgrad + wgrad


def _weighted(shapes: list[tuple[str, int, int, int]], tokens: int, fwd: dict[tuple[int, int], float],
              train: dict[tuple[int, int], float]) -> dict[str, Any]:
    """Forward and training rates FLOP-weighted over `shapes` (`count` layers of each (in, out) shape): their FLOPs
    over the summed seconds; and each shape's own training rate."""
    flops = sum(2 * tokens * k * n * count for _, k, n, count in shapes)
    fwd_time = sum(fwd[k, n] * count for _, k, n, count in shapes)
    train_time = sum(train[k, n] * count for _, k, n, count in shapes)
    return {"forward": flops / fwd_time, "train": 3 * flops / train_time,
            "per_shape": {name: 6 * tokens * k * n / train[k, n] for name, k, n, _ in shapes}}


def rates_from_times(shapes: list[tuple[str, int, int, int]], tokens: int,
                     times: dict[str, dict[tuple[int, int], tuple[float, float]]]) -> dict[str, Any]:
    """A model's GEMM rates from each kernel's (forward, training) seconds per (in, out) shape: each kernel's
    (under "kernels"), and the machine's at the top level: each shape on its faster kernel (its forward alone on the
    kernel with the faster forward), what a per-layer choice of kernel reaches (rlhfkit.models.cpu_gemm chooses per
    call); "kernel_of" names each shape's faster kernel for training."""
    out = {"kernels": {kernel: _weighted(shapes, tokens, {kn: t[0] for kn, t in by_shape.items()},
                                         {kn: t[1] for kn, t in by_shape.items()})
                       for kernel, by_shape in times.items()}}
    keys = {(k, n) for _, k, n, _ in shapes}
    best_fwd = {kn: min(t[kn][0] for t in times.values()) for kn in keys}
    best_train = {kn: min(t[kn][1] for t in times.values()) for kn in keys}
    kernel_of = {name: min(times, key=lambda kernel, kn=(k, n): times[kernel][kn][1]) for name, k, n, _ in shapes}
    return {**_weighted(shapes, tokens, best_fwd, best_train), "kernel_of": kernel_of, **out}


def model_rates(config: dict[str, Any], tokens: int, threads: int, dtype: Any = None, seconds: float = 0.15,
                kernels: Sequence[str] | None = None) -> dict[str, Any]:
    """The model's GEMM rates (FLOP/s) at `tokens` rows (`rates_from_times`): forward, and training (forward and
    both backward products), FLOP-weighted over its shapes, the machine's (each shape on its faster kernel) and
    each kernel's; fp32 on every kernel of `fp32_kernels()` (or `kernels`), bf16 on aten."""
    import torch

    dtype = dtype or torch.float32
    kernels = kernels or (fp32_kernels() if dtype == torch.float32 else ("aten",))
    shapes = linear_shapes(config)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        times: dict[str, dict[tuple[int, int], tuple[float, float]]] = {}
        for kernel in kernels:
            times[kernel] = {}
            for _, k, n, _ in shapes:
                if (k, n) not in times[kernel]:
                    times[kernel][k, n] = linear_times(tokens, k, n, dtype, seconds, threads, kernel)
    finally:
        torch.set_num_threads(before)
    return rates_from_times(shapes, tokens, times)


def bandwidth(threads: int, seconds: float = 0.5, floats: int = 2**25) -> dict[str, float]:
    """Bytes per second of a copy (read + write) and of a STREAM triad `a = b + s * c` (two reads, one write) on
    arrays of `floats` fp32 (128 MB each by default, 4x the last-level cache)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b, c = torch.zeros(floats), torch.rand(floats), torch.rand(floats)
        copy = best_time(lambda: a.copy_(b), seconds, threads)
        triad = best_time(lambda: torch.add(b, c, alpha=3.0, out=a), seconds, threads)
    finally:
        torch.set_num_threads(before)
    return {"copy": 8 * floats / copy, "triad": 12 * floats / triad}


def bf16_supported() -> bool:
    """bf16 matmuls run natively (AVX512-BF16 or AMX-BF16); elsewhere they are emulated, a rate of no meaning."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " avx512_bf16" in flags or " amx_bf16" in flags


# -- the workloads' floors -----------------------------------------------------------------------------------------
class Limit:
    """The rates a bench parent needs, measured once per (model, tokens, threads) in this process."""

    def __init__(self, models: dict[str, Path], threads: int, seconds: float = 0.1) -> None:
        self.models, self.threads, self.seconds = models, threads, seconds
        self._rates: dict[tuple[str, int], dict[str, Any]] = {}
        self._bandwidth: float | None = None

    def rate(self, model: str, tokens: int, kind: str = "train") -> float:
        """The model's fp32 GEMM rate at the measured token count nearest `tokens` (on a log scale)."""
        import math

        nearest = min(TOKENS["25m"], key=lambda m: abs(math.log(m / max(tokens, 1))))
        key = (model, nearest)
        if key not in self._rates:
            self._rates[key] = model_rates(config_of(self.models[model]), nearest, self.threads, seconds=self.seconds)
        return float(self._rates[key][kind])

    def bandwidth(self) -> float:
        if self._bandwidth is None:
            self._bandwidth = bandwidth(self.threads)["triad"]
        return self._bandwidth

    def decode_floor(self, model: str, rows: int, steps: int) -> float:
        """Seconds `steps` decode steps of `rows` sequences need at least: per step, the larger of its matmul FLOPs
        over the forward rate and its weight bytes (fp32, read once a step) over the triad bandwidth."""
        shape = model_shape(config_of(self.models[model]))
        compute = 2 * shape.matmul_params * rows / self.rate(model, rows, "forward")
        memory = 4 * shape.matmul_params / self.bandwidth()
        return steps * max(compute, memory)

    def generation_floor(self, model: str, prompts: Sequence[int], samples: int, new_tokens: float) -> float:
        """Seconds sampling `samples` answers of `new_tokens` tokens to each prompt (of these lengths) needs at
        least: its forward FLOPs (each prompt once) at the forward rate for a decode batch of all the sequences,
        or, if larger, the weight bytes read once per decode step over the triad bandwidth."""
        shape = model_shape(config_of(self.models[model]))
        flops = sum(shared_prefix_flops(shape, p, [new_tokens] * samples, train=False) for p in prompts)
        rows = len(prompts) * samples
        return max(flops / self.rate(model, rows, "forward"), new_tokens * 4 * shape.matmul_params / self.bandwidth())

    def describe(self) -> str:
        lines = [f"{m} at {t} tokens: train {r['train'] / 1e9:.0f} ({kernel_cells(r)}), forward "
                 f"{r['forward'] / 1e9:.0f}" for (m, t), r in self._rates.items()]
        bw = f"; triad bandwidth {self._bandwidth / 1e9:.1f} GB/s" if self._bandwidth else ""
        return (f"Machine limit (bench/machine_limit.py, measured by this run's parent at {self.threads} threads, "
                f"fp32 GFLOP/s FLOP-weighted over the model's linear shapes, each shape on its faster kernel; "
                f"each kernel's own rate in brackets): " + "; ".join(lines) + bw + ".")


def kernel_cells(rates: dict[str, Any]) -> str:
    """Each kernel's training rate, GFLOP/s: "aten 95, onednn 210"."""
    return ", ".join(f"{k} {r['train'] / 1e9:.0f}" for k, r in rates.get("kernels", {}).items())


def fraction_cells(floor: float, times: Sequence[float]) -> str:
    import statistics

    return f"{100 * floor / statistics.median(times):.0f}%"


# -- the machine table ---------------------------------------------------------------------------------------------
def measure_all(configs: dict[str, dict[str, Any]], rounds: int, seconds: float,
                threads_list: Sequence[int] = (1, 2)) -> dict[str, Any]:
    """Every model, token count, thread count and dtype, `rounds` times interleaved; the best of the rounds
    (a shared machine only slows a run down) and each round's load."""
    import torch

    dtypes = [torch.float32] + ([torch.bfloat16] if bf16_supported() else [])
    out: dict[str, Any] = {"gemm": {}, "bandwidth": {}, "loads": []}
    for _ in range(rounds):
        for threads in threads_list:
            out["loads"].append(os.getloadavg()[0])
            for name, config in configs.items():
                for tokens in TOKENS[name]:
                    for dtype in dtypes:
                        key = f"{name}|{tokens}|{threads}|{str(dtype).split('.')[-1]}"
                        r = model_rates(config, tokens, threads, dtype, seconds)
                        old = out["gemm"].get(key)
                        out["gemm"][key] = r if old is None or r["train"] > old["train"] else old
                        print(f"{key}: train {r['train'] / 1e9:.0f} GFLOP/s ({kernel_cells(r)}), load "
                              f"{os.getloadavg()[0]:.1f}", flush=True)
            bw = bandwidth(threads)
            old_bw = out["bandwidth"].get(str(threads), {})
            out["bandwidth"][str(threads)] = {k: max(v, old_bw.get(k, 0.0)) for k, v in bw.items()}
    return out


def report(out: dict[str, Any]) -> list[str]:
    """The GEMM table (train: the machine's, each shape on its faster kernel; then each kernel's) and bandwidth."""
    rows = ["| model | tokens | threads | dtype | train GFLOP/s | per kernel (train) | forward GFLOP/s | "
            "per shape (train, its faster kernel) |", "| --- " * 8 + "|"]
    for key, r in out["gemm"].items():
        name, tokens, threads, dtype = key.split("|")
        kernel_of = r.get("kernel_of", {})
        shapes = ", ".join(f"{s} {v / 1e9:.0f}" + (f" {kernel_of[s]}" if s in kernel_of else "")
                           for s, v in r["per_shape"].items())
        rows.append(f"| {name} | {tokens} | {threads} | {dtype} | {r['train'] / 1e9:.0f} | {kernel_cells(r)} | "
                    f"{r['forward'] / 1e9:.0f} | {shapes} |")
    rows += ["", "| threads | copy GB/s | triad GB/s |", "| --- | --- | --- |"]
    rows += [f"| {t} | {b['copy'] / 1e9:.1f} | {b['triad'] / 1e9:.1f} |" for t, b in out["bandwidth"].items()]
    return rows


def main() -> None:
    import argparse
    import platform

    import torch

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds; each figure is the best round's")
    p.add_argument("--seconds", type=float, default=0.15, help="timing budget per product")
    p.add_argument("--threads", default="1,2", help="comma-separated torch thread counts")
    p.add_argument("--workdir", default=str(Path(__file__).resolve().parents[1] / "runs" / "bench"))
    args = p.parse_args()
    from common import build_models

    _, models = build_models(Path(args.workdir).resolve())
    configs = {name: config_of(path) for name, path in models.items()} | {"135m": SMOLLM2_135M}
    start = os.getloadavg()
    out = measure_all(configs, args.rounds, args.seconds, [int(t) for t in args.threads.split(",")])
    out.update(machine=platform.processor() or platform.machine(), cpus=os.cpu_count(), torch=torch.__version__,
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
               load_start=start, load_end=os.getloadavg(), bf16=bf16_supported())
    RESULTS.write_text(json.dumps(out, indent=1) + "\n")
    print("\n".join(report(out)))
    print(f"load at start {start}, at end {out['load_end']}, per round {out['loads']}; written {RESULTS}")


if __name__ == "__main__":
    main()
