"""`rlhfkit demo --vlm`: SFT then GRPO on image prompts with the embedded tiny vision-language model, offline.

Builds the tiny random-init Qwen2-VL and its seeded image tasks (rlhfkit/demo/vlm_assets.py: count the dots, the
square's colour, a seven-segment digit), fine-tunes it with SFT on image prompts (`train_sft --image_key`), then
runs GRPO from the SFT model (`train_ppo --image_key --freeze_visual_encoder`, the Transformers engine, the
exact-match reward of rlhfkit/demo/reward_func.py). Held-out exact match (greedy, through `batch_inference
--image_key`) is printed before and after each stage; models, metrics and `<out>/report.md` go under --out. The
recipe is bench/vlm_learning.py's, shortened to run in a few minutes on 2 cores (the bench's longer GRPO is what
lifts the colour task: bench/results/vlm_learning.md).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from pathlib import Path

from rlhfkit.cli.common import quiet_libraries

PROG = "rlhfkit demo --vlm"
REWARD_FUNC = Path(__file__).parents[1] / "demo" / "reward_func.py"
IMAGE_FLAGS = ["--input_key", "prompt", "--apply_chat_template", "--image_key", "images"]


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__)
    p.add_argument("--out", default="runs/demo-vlm", help="output directory for assets, models, metrics, report")
    p.add_argument("--seed", type=int, default=0, help="seed for assets and training")
    p.add_argument("--sft_steps", type=int, default=25, help="SFT optimizer steps (batch 32)")
    p.add_argument("--grpo_steps", type=int, default=40, help="GRPO optimizer steps (0 skips the stage)")
    p.add_argument("--grpo_prompts", type=int, default=16, help="GRPO prompts per step")
    p.add_argument("--grpo_samples", type=int, default=8, help="GRPO samples per prompt")
    p.add_argument("--n_eval", type=int, default=200, help="held-out image prompts")
    p.add_argument("--n_train", type=int, default=3000, help="SFT records drawn (and as many RL prompts, at most "
                                                             "2000)")
    return p.parse_args(argv)


def sft_argv(model: Path, data: Path, save: Path, steps: int, seed: int) -> list[str]:
    """train_sft on image prompts: bench/vlm_learning.py's SFT (batch 32, lr 1e-3 constant)."""
    return ["--pretrain", str(model), "--dataset", str(data), *IMAGE_FLAGS, "--output_key", "answer",
            "--max_len", "64", "--train_batch_size", "32", "--micro_train_batch_size", "32", "--learning_rate",
            "1e-3", "--lr_scheduler", "constant", "--max_epochs", "20", "--max_steps", str(steps), "--zero_stage",
            "0", "--seed", str(seed), "--save_path", str(save), "--save_steps", "-1", "--logging_steps", "5",
            "--disable_progress_bar"]


def grpo_argv(sft: Path, prompts: Path, save: Path, args: argparse.Namespace) -> list[str]:
    """train_ppo GRPO on image prompts from the SFT model, vision tower frozen: bench/vlm_learning.py's recipe
    (group_norm, lr 3e-4 constant, 4 new tokens, exact-match reward) with fewer prompts, samples and steps."""
    samples = args.grpo_prompts * args.grpo_samples
    micro = str(min(32, samples))
    return ["--pretrain", str(sft), "--prompt_data", str(prompts), *IMAGE_FLAGS, "--label_key", "answer",
            "--freeze_visual_encoder", "--remote_rm_url", str(REWARD_FUNC), "--advantage_estimator", "group_norm",
            "--n_samples_per_prompt", str(args.grpo_samples), "--rollout_batch_size", str(args.grpo_prompts),
            "--train_batch_size", str(samples), "--micro_train_batch_size", micro, "--micro_rollout_batch_size",
            micro, "--generate_max_len", "4", "--prompt_max_len", "64", "--max_rl_steps", str(args.grpo_steps),
            "--actor_learning_rate", "3e-4", "--lr_scheduler", "constant", "--zero_stage", "0", "--seed",
            str(args.seed), "--save_path", str(save), "--save_steps", "-1", "--logging_steps", "1",
            "--disable_progress_bar"]


def eval_argv(model: str, data: Path, out: Path) -> list[str]:
    """batch_inference on the held-out image prompts: greedy, 4 new tokens, scored by the exact-match reward (the
    mean reward is the exact match)."""
    return ["--eval_task", "generate", "--pretrain", model, "--dataset", str(data), *IMAGE_FLAGS, "--label_key",
            "answer", "--greedy_sampling", "--max_new_tokens", "4", "--micro_batch_size", "32", "--remote_rm_url",
            str(REWARD_FUNC), "--output_path", str(out)]


def exact_match(model: str, data: Path, out: Path) -> float:
    from rlhfkit.config.base import parse_config
    from rlhfkit.config.batch_inference import BatchInferenceConfig
    from rlhfkit.inference.batch import run_batch_inference

    return float(run_batch_inference(parse_config(BatchInferenceConfig, eval_argv(model, data, out), PROG))
                 ["reward_mean"])


def run_vlm_demo(argv: Sequence[str] | None = None) -> int:
    """The demo (module docstring)."""
    args = _parse(argv)  # first: --help and flag errors need no torch import
    quiet_libraries()
    import torch

    torch.set_num_threads(1)  # as the main demo: one thread measured faster than two on the 2-core machines
    from rlhfkit.config.base import parse_config
    from rlhfkit.config.rl import PPOConfig
    from rlhfkit.config.sft import SFTConfig
    from rlhfkit.demo.vlm_assets import build_vlm_assets
    from rlhfkit.rl.local_run import run_ppo
    from rlhfkit.trainers.sft import run_sft

    out, started = Path(args.out).resolve(), time.time()
    assets = build_vlm_assets(out / "assets", seed=args.seed, n_sft=args.n_train, n_eval=args.n_eval, n_pref=16,
                              n_rl=min(args.n_train, 2000))
    held_out = assets.split("sft_eval")
    print(f"[demo] assets in {assets.root}; {args.n_eval} held-out image prompts")
    rows, em = [], exact_match(str(assets.model_dir), held_out, out / "eval_untrained.jsonl")
    print(f"[demo] held-out image exact-match before SFT: {em:.3f}")
    sft, t = out / "sft", time.time()
    run_sft(parse_config(SFTConfig, sft_argv(assets.model_dir, assets.split("sft_train"), sft, args.sft_steps,
                                             args.seed), PROG))
    after_sft = exact_match(str(sft), held_out, out / "eval_sft.jsonl")
    print(f"[demo] held-out image exact-match after SFT:  {after_sft:.3f} ({time.time() - t:.0f} s)")
    rows.append(f"| SFT on image prompts, exact-match | {em:.3f} | {after_sft:.3f} |")
    outputs = [f"SFT model: `{sft}` (metrics: `{sft}/metrics.jsonl`)  "]
    if args.grpo_steps > 0:
        grpo, t = out / "grpo", time.time()
        run_ppo(parse_config(PPOConfig, grpo_argv(sft, assets.split("rl_train"), grpo, args), PROG))
        after = exact_match(str(grpo), held_out, out / "eval_grpo.jsonl")
        print(f"[demo] held-out image exact-match after GRPO: {after:.3f} (SFT model: {after_sft:.3f}, "
              f"{after - after_sft:+.3f}; {time.time() - t:.0f} s)")
        rows.append(f"| GRPO from the SFT model, exact-match | {after_sft:.3f} | {after:.3f} |")
        outputs.append(f"GRPO policy: `{grpo}` (metrics: `{grpo}/metrics.jsonl`)  ")
    report = out / "report.md"
    report.write_text("\n".join(["# rlhfkit VLM demo report", "", "| stage, held-out metric | before | after |",
                                 "| --- | --- | --- |", *rows, "", *outputs,
                                 f"Total time: {time.time() - started:.0f} s"]) + "\n")
    print(f"[demo] done in {time.time() - started:.0f} s")
    for line in outputs:
        print(f"[demo] {line.rstrip()}")
    print(f"[demo] report:      {report}")
    return 0
