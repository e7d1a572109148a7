"""Benchmark: LoRA weight sync, adapter-only vs merged, on each rollout engine (train_ppo_ray, local Ray, CPU).

One run: the demo assets, then the same short GRPO run of a LoRA policy (`--lora_rank`, default 8) four times:
{vLLM, Transformers engine} x {--lora_sync adapter, --lora_sync merged}, in one local Ray cluster. Reports, per
sync, the bytes moved to each engine (`sync/bytes`), the adapter's size (`sync/adapter_bytes`), the sync's wall time
(`time/sync_s`) and the engine/trainer log-prob gap the trainer measures (`rollout_logprob_diff`, mean over response
tokens, fp32), and appends the table with the machine, versions, load and date to bench/results/lora_sync.md.

    OMP_NUM_THREADS=1 nice .venv/bin/python bench/lora_sync.py [--out runs/bench_lora_sync] [--steps 4]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import load, machine  # noqa: E402

RESULTS = Path(__file__).with_name("results") / "lora_sync.md"
REWARD = Path(__file__).resolve().parents[1] / "tests" / "distributed" / "reward_exact_match.py"


def argv(assets, out: Path, engine: str, mode: str, steps: int, rank: int) -> list[str]:
    return ["--pretrain", str(assets.model_dir), "--prompt_data", str(assets.rl_train), "--input_key", "prompt",
            "--label_key", "answer", "--input_template", "User: {}\nAssistant: ", "--max_samples", str(4 * steps),
            "--rollout_batch_size", "4", "--n_samples_per_prompt", "4", "--micro_rollout_batch_size", "16",
            "--train_batch_size", "16", "--micro_train_batch_size", "8", "--generate_max_len", "8",
            "--prompt_max_len", "32", "--actor_learning_rate", "5e-3", "--zero_stage", "2",
            "--advantage_estimator", "group_norm", "--remote_rm_url", str(REWARD), "--init_kl_coef", "0",
            "--lora_rank", str(rank), "--lora_alpha", str(2 * rank), "--lora_sync", mode,
            "--vllm_num_engines", "1" if engine == "vllm" else "0", "--save_path", str(out / "final"),
            "--disable_progress_bar", "--actor_num_gpus_per_node", "1", "--eval_steps", "-1"]


def run_case(assets, out: Path, engine: str, mode: str, steps: int, rank: int) -> dict[str, float]:
    from rlhfkit.config.base import parse_config
    from rlhfkit.config.rl import PPOConfig
    from rlhfkit.rl.ray_run import run_ppo_ray

    shutil.rmtree(out, ignore_errors=True)
    run_ppo_ray(parse_config(PPOConfig, argv(assets, out, engine, mode, steps, rank), "bench"), save=False)
    rows = [json.loads(line) for line in (out / "final" / "metrics.jsonl").read_text().splitlines()]
    steps_rows = [r for r in rows if "train/sync/bytes" in r]
    return {"bytes": statistics.median(r["train/sync/bytes"] for r in steps_rows),
            "adapter": statistics.median(r.get("train/sync/adapter_bytes", 0.0) for r in steps_rows),
            "sync_s": statistics.median(r["train/time/sync_s"] for r in steps_rows),
            "gap": max(r["train/rollout_logprob_diff"] for r in steps_rows[1:] or steps_rows),
            "steps": len(steps_rows)}


def ratio(row: dict[str, float]) -> str:
    """Bytes moved per byte of adapter ("-" for a merged sync, which logs no adapter size)."""
    return f"{row['bytes'] / row['adapter']:.3f}" if row["adapter"] else "-"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/bench_lora_sync")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--rank", type=int, default=8)
    args = p.parse_args()

    import ray
    import torch
    from transformers import AutoModelForCausalLM

    from rlhfkit.demo.assets import build_demo_assets

    torch.set_num_threads(1)
    out = Path(args.out).resolve()
    assets = build_demo_assets(out / "assets", seed=0)
    model_bytes = sum(t.numel() * 4 for t in AutoModelForCausalLM.from_pretrained(assets.model_dir).parameters())
    load_start = load()
    ray.init(address="local", num_cpus=8, num_gpus=0, include_dashboard=False, log_to_driver=False,
             logging_level="ERROR")
    try:
        rows = {(engine, mode): run_case(assets, out / f"{engine}_{mode}", engine, mode, args.steps, args.rank)
                for engine in ("vllm", "transformers") for mode in ("adapter", "merged")}
    finally:
        ray.shutdown()
    table = [
        f"## {datetime.date.today().isoformat()}: {args.steps} GRPO steps of a rank-{args.rank} LoRA policy on the "
        f"demo model ({model_bytes} bytes of fp32 weights)", "",
        f"Machine: {machine()}, load at start {load_start} (1/5/15 min), shared; OMP_NUM_THREADS="
        f"{os.environ.get('OMP_NUM_THREADS')}.", "",
        "| engine | --lora_sync | bytes per sync (median) | adapter bytes | bytes / adapter | sync wall time (s, "
        "median) | max rollout_logprob_diff (steps 2+) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
        *[f"| {engine} | {mode} | {r['bytes']:.0f} | {r['adapter']:.0f} | {ratio(r)} | {r['sync_s']:.3f} | "
          f"{r['gap']:.2e} |" for (engine, mode), r in rows.items()], "", "",
    ]
    print("\n".join(table))
    if not RESULTS.exists():
        RESULTS.write_text("# LoRA weight sync: adapter-only vs merged\n\nScript: `bench/lora_sync.py`. Each "
                           "section is one run of it.\n\n")
    with RESULTS.open("a") as f:
        f.write("\n".join(table))


if __name__ == "__main__":
    main()
