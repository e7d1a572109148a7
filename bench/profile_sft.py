"""Where an rlhfkit SFT step's time goes, beside the machine's limit: torch.profiler (CPU) around one optimizer step
of a bench/sft.py case (after a warm-up step), its operators grouped into matmuls (the GEMMs the limit measures),
attention, the loss, the optimizer and the rest, and the step's model FLOPs over the matmuls' own time.

    .venv/bin/python bench/profile_sft.py [--case 25m-512c] [--threads 1] [--rows 30]

Run bench/sft.py once first (it writes the case's data under --workdir).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

GROUPS = {  # operator name fragments -> group (first match wins)
    "matmul": ("aten::mm", "aten::addmm", "aten::bmm", "aten::linear", "aten::matmul"),
    "attention": ("scaled_dot_product", "flash_attention", "_softmax", "baddbmm"),
    "loss": ("cross_entropy", "log_softmax", "nll_loss", "logsumexp"),
    "optimizer": ("adam", "_foreach", "clip_grad", "norm"),
}


def group_of(name: str) -> str:
    return next((g for g, keys in GROUPS.items() if any(k in name.lower() for k in keys)), "other")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--case", default="25m-512c")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rows", type=int, default=30, help="operators listed (by self CPU time)")
    p.add_argument("--workdir", default=str(Path(__file__).resolve().parents[1] / "runs" / "bench"))
    args = p.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    import machine_limit
    import sft
    from common import build_models
    from torch.profiler import ProfilerActivity, profile

    from rlhfkit.trainers.sft import SFTTrainer

    workdir = Path(args.workdir).resolve()
    _, models = build_models(workdir)
    model, max_len, *_ = sft.CASES[args.case]
    data = workdir / "data" / f"sft_{args.case}.jsonl"
    flops, tokens = sft.step_flops(models[model], data, max_len)
    original, seen, out = SFTTrainer.train_batch, [], {}

    def profiled(self, *a, **kw):  # the second step under the profiler, the first a warm-up
        if len(seen) != 1:
            seen.append(1)
            return original(self, *a, **kw)
        seen.append(1)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            metrics = original(self, *a, **kw)
            out["wall"] = time.perf_counter() - start
        out["prof"] = prof
        return metrics

    SFTTrainer.train_batch = profiled
    sft.child_rlhfkit(models[model], data, workdir / "profile_sft", max_len, 2)
    events = out["prof"].key_averages()
    print(events.table(sort_by="self_cpu_time_total", row_limit=args.rows))
    by_group: dict[str, float] = {}
    for e in events:
        by_group[group_of(e.key)] = by_group.get(group_of(e.key), 0.0) + e.self_cpu_time_total / 1e6
    total = sum(by_group.values())
    rate = machine_limit.Limit(models, args.threads).rate(model, tokens)
    print(f"case {args.case}, {args.threads} threads, load {os.getloadavg()[0]:.2f}: step {out['wall']:.2f} s "
          f"(profiled), model FLOPs {flops / 1e12:.3f} T, floor at the measured GEMM rate "
          f"({rate / 1e9:.0f} GFLOP/s) {flops / rate:.2f} s = {100 * flops / rate / out['wall']:.0f}% of the step")
    for g, s in sorted(by_group.items(), key=lambda kv: -kv[1]):
        print(f"  {g:>10}: {s:6.2f} s self CPU ({100 * s / total:.0f}%)")


if __name__ == "__main__":
    main()
