"""Benchmark: RL step time of the demo's GRPO stage on a length-skewed prompt set, padded vs packed vs packed with a
token budget, side by side in one run.

The demo's GRPO stage (`rlhfkit/cli/demo.py`: train_ppo_ray, hybrid engine on a local Ray cluster, 16 prompts x 8
samples, 64 samples per training micro-batch) runs three times from the same SFT model, on the same prompts and
seed, changing only how the scoring and training forwards are batched:
- padded: the default, rows right-padded to the longest row of the micro-batch;
- packed: `--packing_samples`, each micro-batch's rows in one packed row (docs/CONVENTIONS.md);
- packed + token budget: also `--use_dynamic_batch --max_tokens_per_gpu N`.
The prompt set is skewed on purpose: a fraction of the addition prompts carry a long preamble, so most rows of a
micro-batch are short and a few are long, and padding wastes most of a padded forward. The Transformers rollout
engine is used in all three (generation is the same work in each; the table shows it apart).

Reports the median per-step times over the steps after the first (which includes warm-up), the padding share, and
the mean reward (the runs must learn alike), and appends the table with the machine, versions, date and load to
bench/results/rl_packing.md.

    OMP_NUM_THREADS=1 .venv/bin/python bench/rl_packing.py [--out runs/bench_rl_packing] [--steps 12]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from grpo_engines import versions  # noqa: E402

RESULTS = Path(__file__).with_name("results") / "rl_packing.md"
PREAMBLE = ("Read the following note before you answer. The note is long on purpose and has nothing to do with the "
            "question: the quick brown fox jumps over the lazy dog while the river runs to the sea and the wind "
            "turns the pages of an old book that nobody reads any more. ")
VARIANTS = {"padded": [], "packed": ["--packing_samples"]}


def skewed_prompts(src: Path, dst: Path, every: int, repeats: int) -> list[bool]:
    """Write `src`'s prompts to `dst`, every `every`-th one with a long preamble; returns which ones are long."""
    records = [json.loads(line) for line in src.read_text().splitlines()]
    long = [i % every == 0 for i in range(len(records))]
    records = [{**r, "prompt": PREAMBLE * repeats + r["prompt"]} if is_long else r
               for r, is_long in zip(records, long)]
    dst.write_text("".join(json.dumps(r) + "\n" for r in records))
    return long


def step_times(metrics_path: Path) -> dict[str, float]:
    records = [json.loads(line) for line in metrics_path.read_text().splitlines()]
    train = [r for r in records if "train/time/step_s" in r][1:]  # the first step includes warm-up

    def median(key: str) -> float:
        return statistics.median(r[f"train/{key}"] for r in train)

    return {"steps": len(train) + 1, "step_s": median("time/step_s"), "generate_s": median("time/generate_s"),
            "score_s": median("time/score_s"), "train_s": median("time/train_s"),
            "reward": statistics.fmean(r["train/reward"] for r in train),
            "response_length": statistics.fmean(r["train/response_length"] for r in train)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/bench_rl_packing")
    p.add_argument("--steps", type=int, default=12, help="GRPO steps per variant")
    p.add_argument("--sft_steps", type=int, default=300, help="SFT steps before GRPO (short answers, as the demo)")
    p.add_argument("--long_every", type=int, default=4, help="every n-th prompt gets the long preamble")
    p.add_argument("--preamble_repeats", type=int, default=1)
    p.add_argument("--prompt_max_len", type=int, default=192)
    p.add_argument("--max_tokens_per_gpu", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    import torch

    torch.set_num_threads(1)
    from rlhfkit.cli.demo import addition_records, grpo_argv, run_sft_stage
    from rlhfkit.config.base import parse_config
    from rlhfkit.config.rl import PPOConfig
    from rlhfkit.demo.assets import build_demo_assets
    from rlhfkit.models.loading import load_tokenizer
    from rlhfkit.rl.ray_run import run_ppo_ray

    out = Path(args.out).resolve()
    assets = build_demo_assets(out / "assets", seed=args.seed)
    sft_data, rl_prompts, _ = addition_records(assets)
    sft_dir = run_sft_stage(assets, sft_data, out, args.sft_steps, args.seed)
    prompts = out / "skewed_prompts.jsonl"
    is_long = skewed_prompts(rl_prompts, prompts, args.long_every, args.preamble_repeats)
    tok = load_tokenizer(sft_dir)
    records = [json.loads(line) for line in prompts.read_text().splitlines()]
    token_lengths = [len(tok(r["prompt"]).input_ids) for r in records]
    variants = {**VARIANTS, f"packed + token budget {args.max_tokens_per_gpu}": [
        "--packing_samples", "--use_dynamic_batch", "--max_tokens_per_gpu", str(args.max_tokens_per_gpu)]}
    load_before = os.getloadavg()
    rows = {}
    for name, flags in variants.items():
        run_dir = out / (name.split(" ")[0] + ("_budget" if "budget" in name else ""))
        shutil.rmtree(run_dir, ignore_errors=True)  # metrics files are appended to: start each run clean
        argv = [*grpo_argv(sft_dir, prompts, run_dir / "grpo", args.steps, args.seed, use_vllm=False),
                "--prompt_max_len", str(args.prompt_max_len), *flags]
        trainer = run_ppo_ray(parse_config(PPOConfig, argv, "bench"))
        rows[name] = step_times(Path(trainer.logger.path))
        print(name, rows[name], flush=True)
    load_after = os.getloadavg()

    base = rows["padded"]
    short = [n for n, lo in zip(token_lengths, is_long) if not lo]
    long = [n for n, lo in zip(token_lengths, is_long) if lo]
    table = [
        f"## {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC: demo GRPO stage, length-skewed "
        f"prompts, {args.steps} steps per variant",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}, Python "
        f"{platform.python_version()}; {versions()}. OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}. "
        f"Load average (1/5/15 min) before {load_before[0]:.1f}/{load_before[1]:.1f}/{load_before[2]:.1f}, after "
        f"{load_after[0]:.1f}/{load_after[1]:.1f}/{load_after[2]:.1f}"
        + (" (the machine was shared with other work during this run: absolute times are inflated and noisy; "
           "the variants ran back to back under similar load)" if max(load_before[0], load_after[0]) > 2.5 else "")
        + ".",
        f"Setup: the demo's GRPO stage (train_ppo_ray, hybrid engine, Transformers rollout engine, 16 prompts x 8 "
        f"samples, micro_train_batch_size 64, micro_rollout_batch_size 128, generate_max_len 8, ZeRO-0) from a "
        f"{args.sft_steps}-step SFT model, --prompt_max_len {args.prompt_max_len}. Prompts: {len(short)} short "
        f"(median {statistics.median(short):.0f} tokens) and {len(long)} long (median "
        f"{statistics.median(long):.0f} tokens): every {args.long_every}th prompt has a long preamble. Times are "
        f"medians over steps 2..{args.steps} (step 1 includes warm-up).",
        "",
        "| variant | step (s) | generate (s) | score: actor forward + reward (s) | train (s) | ratio step / padded | "
        "score+train / padded | mean reward | mean response length |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        *[f"| {name} | {r['step_s']:.2f} | {r['generate_s']:.2f} | {r['score_s']:.2f} | {r['train_s']:.2f} | "
          f"{r['step_s'] / base['step_s']:.2f} | "
          f"{(r['score_s'] + r['train_s']) / (base['score_s'] + base['train_s']):.2f} | {r['reward']:.3f} | "
          f"{r['response_length']:.1f} |" for name, r in rows.items()],
        "", "",
    ]
    print("\n".join(table))
    RESULTS.parent.mkdir(exist_ok=True)
    with RESULTS.open("a") as f:
        if f.tell() == 0:
            f.write("# RL sample packing and token-budget micro-batches: demo GRPO stage, length-skewed prompts\n\n"
                    "Script: `bench/rl_packing.py`. Each section is one run of it.\n\n")
        f.write("\n".join(table))


if __name__ == "__main__":
    main()
