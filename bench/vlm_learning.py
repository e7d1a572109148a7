"""Learning on the synthetic image tasks (issue 21, acceptance 3): the tiny random-init Qwen2-VL
(rlhfkit/demo/vlm_assets.py) before and after SFT on image prompts (held-out exact match, greedy), then DPO from the
SFT model (held-out pairwise accuracy of DPO's implicit reward, `eval_acc` of train_dpo), and GRPO from the SFT model
(`train_ppo` on image prompts with the exact-match reward; held-out exact match, greedy).

    nice .venv/bin/python bench/vlm_learning.py [--seeds 0 1] [--sft_steps 120] [--dpo_steps 40] [--grpo_steps 100]

Writes bench/results/vlm_learning.md (`--dpo_steps 0` / `--grpo_steps 0` skip a stage; `--grpo_only` prints the
GRPO figures without rewriting the file). Commands run through the CLIs in subprocesses, exactly as a user types
them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMON = ["--apply_chat_template", "--data.image_key", "images", "--max_len", "64", "--disable_progress_bar",
          "--save_steps", "-1", "--logging_steps", "10"]


def cli(module: str, *args: str) -> None:
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"), PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", f"rlhfkit.cli.{module}", *args], capture_output=True, text=True,
                          env=env, cwd=ROOT)
    if proc.returncode:
        raise SystemExit(f"{module} failed:\n{proc.stderr[-3000:]}")


def eval_hits(model_dir: Path, data: Path) -> list[tuple[str, bool]]:
    """Greedy held-out exact match of the model at `model_dir`, one `(task, right)` per record of `data`, in order
    (so two models' hits on the same records pair up)."""
    import torch

    from rlhfkit.data.readers import load_mixture
    from rlhfkit.data.sft_dataset import SFTDataset
    from rlhfkit.demo.tasks import is_correct
    from rlhfkit.models.loading import load_causal_lm, load_model_config, load_tokenizer
    from rlhfkit.models.vision import record_images

    model, tok = load_causal_lm(str(model_dir)), load_tokenizer(str(model_dir))
    model.eval()
    images = record_images(load_model_config(str(model_dir)), str(model_dir), tok, "images", 1)
    records = load_mixture(str(data), None, "train", 10**6, 0, arg_name="--eval")
    samples = SFTDataset(records, tok, 64, input_key="prompt", output_key="answer", apply_chat_template=True,
                         images=images)
    hits = []
    with torch.no_grad():
        for record, s in zip(records, samples):
            start = int(s["loss_mask"].nonzero()[0])
            ids = s["input_ids"][:start][None]
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=s["pixel_values"],
                                 image_grid_thw=s["image_grid_thw"], max_new_tokens=4, do_sample=False,
                                 pad_token_id=tok.pad_token_id)
            text = tok.decode(out[0, start:], skip_special_tokens=False)
            hits.append((record["task"], is_correct(text, record["answer"])))
    return hits


def summary(hits: list[tuple[str, bool]]) -> tuple[float, dict[str, float]]:
    """Exact match overall and per task."""
    per_task: dict[str, list[bool]] = defaultdict(list)
    for task, right in hits:
        per_task[task].append(right)
    return sum(r for _, r in hits) / len(hits), {t: sum(h) / len(h) for t, h in sorted(per_task.items())}


def exact_match(model_dir: Path, data: Path) -> tuple[float, dict[str, float]]:
    """Greedy held-out exact match (overall, per task) of the model at `model_dir` on the records of `data`."""
    return summary(eval_hits(model_dir, data))


def paired_lift(before: list[tuple[str, bool]], after: list[tuple[str, bool]]) -> tuple[float, float]:
    """Mean and standard error of the per-prompt difference `after - before` (same records, same order): the
    margin of a lift measured on one held-out set, which is tighter than two independent standard errors."""
    diffs = [float(a) - float(b) for (_, b), (_, a) in zip(before, after, strict=True)]
    mean = sum(diffs) / len(diffs)
    var = sum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1)
    return mean, (var / len(diffs)) ** 0.5


def last_eval(save: Path, key: str) -> float:
    rows = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    values = [r[key] for r in rows if key in r]
    if not values:
        raise SystemExit(f"no {key} in {save}/metrics.jsonl: {sorted(rows[-1])}")
    return float(values[-1])


def grpo(assets, sft: Path, out: Path, work: Path, seed: int, args: argparse.Namespace) -> None:
    """GRPO from the SFT model on the RL image prompts with the demo's exact-match reward: `--grpo_prompts` prompts
    per step, `--grpo_samples` samples each, one optimizer step per rollout (the defaults: the first recorded rows)."""
    samples = args.grpo_prompts * args.grpo_samples
    extra = [] if args.grpo_train_vision else ["--actor.freeze_visual_encoder"]
    if args.grpo_dynamic_filtering:  # drop the all-0 / all-1 groups: no GRPO gradient, only noise in the batch
        extra += ["--dynamic_filtering", "--dynamic_filtering_reward_range", "0", "1"]
    cli("train_ppo", "--pretrain", str(sft), "--prompt_data", str(assets.split("rl_train")), "--input_key", "prompt",
        "--label_key", "answer", "--apply_chat_template", "--data.image_key", "images", *extra,
        "--remote_rm_url", str(ROOT / "examples" / "reward_func.py"), "--advantage_estimator", "group_norm",
        "--n_samples_per_prompt", str(args.grpo_samples), "--rollout_batch_size", str(args.grpo_prompts),
        "--train_batch_size", str(samples), "--micro_train_batch_size", "32", "--micro_rollout_batch_size", "32",
        "--generate_max_len", "4", "--prompt_max_len", "64", "--max_rl_steps", str(args.grpo_steps),
        "--actor_learning_rate",
        str(args.grpo_lr), "--lr_scheduler", "constant", "--seed", str(seed), "--save_path", str(out),
        "--ckpt_path", str(work / f"ckpt_grpo_{seed}"), "--disable_progress_bar", "--save_steps", "-1",
        "--logging_steps", "5")


def one_seed(seed: int, work: Path, args: argparse.Namespace) -> dict:
    from rlhfkit.demo.vlm_assets import build_vlm_assets

    assets = build_vlm_assets(work / f"assets_{seed}", seed=seed, n_sft=3000, n_eval=args.n_eval, n_pref=2000,
                              n_rl=2000)
    held_out = assets.split("sft_eval")
    result: dict = {"seed": seed}
    result["untrained"] = exact_match(assets.model_dir, held_out)
    sft = work / f"sft_{seed}"
    t = time.time()
    cli("train_sft", "--pretrain", str(assets.model_dir), "--dataset", str(assets.split("sft_train")),
        "--input_key", "prompt", "--output_key", "answer", "--train_batch_size", "32", "--micro_train_batch_size",
        "32", "--learning_rate", "1e-3", "--lr_scheduler", "constant", "--max_epochs", "20", "--max_steps",
        str(args.sft_steps), "--seed", str(seed), "--save_path", str(sft), "--ckpt_path",
        str(work / f"ckpt_sft_{seed}"), *COMMON)
    result["sft_s"] = time.time() - t
    sft_hits = eval_hits(sft, held_out)
    result["sft"] = summary(sft_hits)
    print(json.dumps(result), flush=True)
    if args.grpo_steps:
        t = time.time()
        grpo(assets, sft, work / f"grpo_{seed}", work, seed, args)
        result["grpo_s"] = time.time() - t
        grpo_hits = eval_hits(work / f"grpo_{seed}", held_out)
        result["grpo"] = summary(grpo_hits)
        result["lift"] = paired_lift(sft_hits, grpo_hits)
        print(json.dumps(result), flush=True)
    if args.dpo_steps:
        result.update(dpo(assets, sft, work, seed, args.dpo_steps))
    return result


def dpo(assets, sft: Path, work: Path, seed: int, steps: int) -> dict:
    """DPO from the SFT model; its held-out pairwise accuracy (`eval/acc` of train_dpo) and wall time."""
    out = work / f"dpo_{seed}"
    t = time.time()
    cli("train_dpo", "--pretrain", str(sft), "--dataset", str(assets.split("pref_train")), "--eval_dataset",
        str(assets.split("pref_eval")), "--eval_split", "train", "--prompt_key", "prompt", "--train_batch_size",
        "32", "--micro_train_batch_size", "16", "--learning_rate", "2e-4", "--max_epochs", "5", "--max_steps",
        str(steps), "--eval_steps", str(steps), "--seed", str(seed), "--save_path", str(out), "--ckpt_path",
        str(work / f"ckpt_dpo_{seed}"), *COMMON)
    return {"dpo_s": time.time() - t, "dpo_eval_acc": last_eval(out, "eval/acc")}


def write(results: list[dict], args: argparse.Namespace, load_start: str) -> Path:
    """Append one section (the command, the machine, a row per seed, the mean lift) to the results file, so the
    rows recorded before stay with the commands that produced them."""
    import importlib.metadata as md

    lines = ["", f"## `python bench/vlm_learning.py {' '.join(sys.argv[1:])}`", "",
             f"Machine {platform.machine()}, {os.cpu_count()} CPUs; torch {md.version('torch')}, transformers "
             f"{md.version('transformers')}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; load average "
             f"{load_start} at the start, {' '.join(f'{x:.2f}' for x in os.getloadavg())} at the end.", "",
             f"SFT: {args.sft_steps} steps of batch 32, lr 1e-3 constant, 3,000 records. GRPO from the SFT model: "
             f"train_ppo, group_norm, {args.grpo_prompts} prompts x {args.grpo_samples} samples per step, "
             f"{args.grpo_steps} steps, lr "
             f"{args.grpo_lr} constant, KL penalty 0.01 (k1), exact-match reward, "
             f"{'vision tower trained' if args.grpo_train_vision else 'frozen vision tower'}"
             f"{', dynamic filtering (all-equal groups dropped)' if args.grpo_dynamic_filtering else ''}. DPO: "
             f"{args.dpo_steps} steps. Held-out: {args.n_eval} image prompts (exact match, greedy, 4 new tokens); "
             "the lift is GRPO - SFT on the same prompts, +- the standard error of the per-prompt difference.", "",
             "| seed | untrained EM | SFT EM | SFT EM per task | GRPO EM | GRPO EM per task | GRPO - SFT | DPO "
             "held-out pairwise acc | SFT s | GRPO s | DPO s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]

    def cell(r: dict, key: str, fmt: str) -> str:
        return format(r[key], fmt) if key in r else "-"

    for r in results:
        per_task = ", ".join(f"{k} {v:.2f}" for k, v in r["sft"][1].items())
        grpo_tasks = ", ".join(f"{k} {v:.2f}" for k, v in r["grpo"][1].items()) if "grpo" in r else "-"
        grpo_em = f"{r['grpo'][0]:.3f}" if "grpo" in r else "-"
        lift = f"{r['lift'][0]:+.3f} +- {r['lift'][1]:.3f}" if "lift" in r else "-"
        lines.append(f"| {r['seed']} | {r['untrained'][0]:.3f} | {r['sft'][0]:.3f} | {per_task} | {grpo_em} | "
                     f"{grpo_tasks} | {lift} | {cell(r, 'dpo_eval_acc', '.3f')} | {r['sft_s']:.0f} | "
                     f"{cell(r, 'grpo_s', '.0f')} | {cell(r, 'dpo_s', '.0f')} |")
    lifts = [r["lift"][0] for r in results if "lift" in r]
    if len(lifts) > 1:
        mean = sum(lifts) / len(lifts)
        se = (sum((x - mean) ** 2 for x in lifts) / (len(lifts) - 1) / len(lifts)) ** 0.5
        lines += ["", f"Mean GRPO - SFT over {len(lifts)} seeds: {mean:+.3f} (standard error over seeds {se:.3f}; "
                  f"smallest {min(lifts):+.3f})."]
    out = ROOT / "bench" / "results" / "vlm_learning.md"
    with out.open("a", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--sft_steps", type=int, default=120)
    p.add_argument("--dpo_steps", type=int, default=40)
    p.add_argument("--grpo_steps", type=int, default=100)
    p.add_argument("--grpo_samples", type=int, default=8, help="samples per prompt (16 prompts per step)")
    p.add_argument("--grpo_prompts", type=int, default=16, help="prompts per GRPO step (one optimizer step each)")
    p.add_argument("--grpo_lr", type=float, default=3e-4)
    p.add_argument("--grpo_dynamic_filtering", action="store_true", help="drop all-0 / all-1 groups")
    p.add_argument("--grpo_train_vision", action="store_true", help="train the vision tower too (default: frozen)")
    p.add_argument("--n_eval", type=int, default=200, help="held-out image prompts (the first 200 are the same)")
    p.add_argument("--grpo_only", action="store_true", help="print the figures, leave the results file alone")
    p.add_argument("--workdir", default="/tmp/rlhfkit_vlm_bench")
    args = p.parse_args()
    load_start = " ".join(f"{x:.2f}" for x in os.getloadavg())
    results = []
    for seed in args.seeds:
        results.append(one_seed(seed, Path(args.workdir), args))
        print(json.dumps(results[-1]), flush=True)
    if not args.grpo_only:
        print(write(results, args, load_start))


if __name__ == "__main__":
    main()
