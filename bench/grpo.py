"""GRPO step time, rlhfkit `run_ppo` (what `python -m rlhfkit.cli.train_ppo` runs: one process, Transformers rollout
engine) vs TRL 1.16.0 `GRPOTrainer` (generation with `model.generate`).

One step, both systems: 16 prompts x 8 samples = 128 completions of at most 32 new tokens (temperature 1), an
exact-match reward (the demo's), group-normalised advantages, no KL term (TRL's default beta 0; rlhfkit
--init_kl_coef 0, so no reference model), and one optimizer step over the 128 samples in two micro-batches of 64.
fp32, AdamW, gradient clipping 1.0. Random-init models rarely stop early, so both generate about 32 tokens a sample
(the table shows the mean response length each system produced).

    .venv/bin/python bench/grpo.py [--case 25m] [--repeats 2] [--threads 2]
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from common import (
    ROOT,
    StepClock,
    build_models,
    count_params,
    ensure_trl,
    interleaved,
    load,
    parent_args,
    table,
    write_section,
)

PROMPTS, SAMPLES, NEW_TOKENS, MICRO = 16, 8, 32, 64
LR = 1e-6
BF16 = False  # the GPU suite (bench/gpu/suite.py) sets it
# case: (model, steps, warm-up steps)
CASES = {"tiny": ("tiny", 4, 1), "25m": ("25m", 3, 1)}
REWARD_FILE = ROOT / "rlhfkit" / "demo" / "reward_func.py"


def write_prompts(workdir: Path, assets) -> Path:
    path = workdir / "data" / "grpo_prompts.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    records = assets.read("rl_train")[:PROMPTS * max(steps for _, steps, _ in CASES.values())]
    path.write_text("".join(json.dumps({"prompt": f"User: {r['prompt']}\nAssistant: ", "answer": r["answer"]}) + "\n"
                            for r in records))
    return path


def child_rlhfkit(model: Path, prompts: Path, out: Path, steps: int) -> StepClock:
    from rlhfkit.config.base import parse_config
    from rlhfkit.config.rl import PPOConfig
    from rlhfkit.trainers.rl_loop import RLTrainer
    from rlhfkit.trainers.rl_run import run_ppo

    clock = StepClock()
    lengths: list[float] = []
    original = RLTrainer.train_step

    def timed(self, indices):
        metrics = original(self, indices)
        clock.tick()
        lengths.append(metrics["response_length"])
        return metrics

    RLTrainer.train_step = timed
    cfg = parse_config(PPOConfig, [
        "--pretrain", str(model), "--prompt_data", str(prompts), "--input_key", "prompt", "--label_key", "answer",
        "--remote_rm_url", str(REWARD_FILE), "--advantage_estimator", "group_norm", "--n_samples_per_prompt",
        str(SAMPLES), "--rollout_batch_size", str(PROMPTS), "--micro_rollout_batch_size", str(MICRO),
        "--train_batch_size", str(PROMPTS * SAMPLES), "--micro_train_batch_size", str(MICRO), "--num_episodes", "1",
        "--max_rl_steps", str(steps), "--generate_max_len", str(NEW_TOKENS), "--prompt_max_len", "64",
        "--temperature", "1.0", "--actor_learning_rate", str(LR), "--lr_warmup_ratio", "0", "--init_kl_coef", "0",
        *(["--bf16"] if BF16 else []), "--zero_stage", "0", "--save_path", str(out), "--disable_progress_bar",
        "--logging_steps", "1",
        "--adam_betas", "0.9", "0.999"], "bench")
    run_ppo(cfg)
    clock.extra["response_length"] = statistics.mean(lengths[1:] or lengths)
    return clock


def child_trl(model_dir: Path, prompts: Path, out: Path, steps: int) -> StepClock:
    import time

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rlhfkit.demo.tasks import is_correct

    clock = StepClock()

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            clock.tick()

    def exact_match(prompts, completions, answer, **kwargs):
        return [float(is_correct(c, str(a))) for c, a in zip(completions, answer)]

    records = [json.loads(x) for x in prompts.read_text().splitlines()]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(model_dir)
    args = GRPOConfig(output_dir=str(out), per_device_train_batch_size=MICRO,
                      gradient_accumulation_steps=PROMPTS * SAMPLES // MICRO, num_generations=SAMPLES,
                      max_completion_length=NEW_TOKENS, temperature=1.0, beta=0.0, num_iterations=1,
                      learning_rate=LR, lr_scheduler_type="constant", max_grad_norm=1.0, max_steps=steps,
                      logging_steps=1, save_strategy="no", report_to="none", use_cpu=not torch.cuda.is_available(),
                     bf16=BF16, fp16=False,
                      gradient_checkpointing=False, disable_tqdm=True, seed=42, dataloader_num_workers=0)
    trainer = GRPOTrainer(model=model, reward_funcs=exact_match, args=args, train_dataset=Dataset.from_list(records),
                          processing_class=tok, callbacks=[Clock()])
    clock.ends = [time.perf_counter()]
    trainer.train()
    lengths = [h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h]
    clock.extra["response_length"] = statistics.mean(lengths[1:] or lengths) if lengths else float("nan")
    return clock


def main() -> None:
    args = parent_args(__doc__, list(CASES))
    workdir = Path(args.workdir).resolve()
    if args.child:
        case = args.case[0]
        model, steps, _ = CASES[case]
        _, models = build_models(workdir)
        run = child_rlhfkit if args.child == "rlhfkit" else child_trl
        clock = run(models[model], workdir / "data" / "grpo_prompts.jsonl", workdir / f"grpo_{case}_{args.child}",
                    steps)
        clock.report()
        return
    started_load = load()
    ensure_trl()
    assets, models = build_models(workdir)
    write_prompts(workdir, assets)
    cases = args.case or list(CASES)
    sizes = {name: count_params(path) / 1e6 for name, path in models.items()}
    settings = (f"Settings: {PROMPTS} prompts x {SAMPLES} samples, at most {NEW_TOKENS} new tokens, temperature 1, "
                f"exact-match reward, group-normalised advantages, no KL / reference, one optimizer step per rollout "
                f"(2 micro-batches of {MICRO}), fp32, AdamW, lr {LR}; rlhfkit `train_ppo` (one process, Transformers "
                f"engine) vs TRL GRPOTrainer (model.generate); {args.threads} torch threads per process, "
                f"{args.repeats} interleaved runs per system; step time = median gap between optimizer-step ends "
                "after the warm-up step (generation, scoring, training: the whole RL step).")
    results = {}
    for case in cases:  # the section is rewritten after each case
        results.update(interleaved(Path(__file__), [case], args.repeats, args.threads, CASES[case][2]))
        lines = table(results, describe=lambda case: f"{CASES[case][0]} ({sizes[CASES[case][0]]:.1f}M)")
        lines += ["", "Mean response length (tokens): " + "; ".join(
            f"{case}: rlhfkit {r['rlhfkit']['extra'].get('response_length', float('nan')):.1f}, TRL "
            f"{r['trl']['extra'].get('response_length', float('nan')):.1f}" for case, r in results.items())]
        path = write_section("grpo", "GRPO step time", lines, started_load, settings,
                             Path(args.results) if args.results else None)
    print(f"results: {path}")


if __name__ == "__main__":
    main()
