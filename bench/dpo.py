"""DPO step time, rlhfkit (`run_dpo`, what `python -m rlhfkit.cli.train_dpo` runs) vs TRL 1.16.0 `DPOTrainer`.

Same model, preference pairs, batch (8 pairs, one micro-batch), max_len, beta 0.1, sigmoid loss, a frozen reference
model forwarded every step (no precomputed reference log-probs), fp32, AdamW, gradient clipping 1.0. Cases: the
demo model and a ~25M-parameter random-init Llama on the demo's short pairs, and the 25M model on ~104-token
prompts (max_len 128).

    .venv/bin/python bench/dpo.py [--case 25m-128] [--repeats 2] [--threads 2]
"""

from __future__ import annotations

import json
from pathlib import Path

import machine_limit
from common import (
    StepClock,
    build_models,
    count_params,
    ensure_trl,
    interleaved,
    load,
    long_prompt,
    parent_args,
    table,
    write_section,
)

BATCH = 8
EXTRA: list[str] = []  # more rlhfkit flags for the rlhfkit child (bench/gpu: --backend fsdp2)
LR = 1e-5
BF16 = False  # the GPU suite (bench/gpu/suite.py) sets it
BETA = 0.1
# case: (model, max_len, prompt tokens (0: the demo's short questions), steps, warm-up steps)
CASES = {"tiny-short": ("tiny", 128, 0, 10, 2), "25m-short": ("25m", 128, 0, 6, 2),
         "25m-128": ("25m", 128, 104, 4, 1)}


def write_data(workdir: Path, assets, models: dict[str, Path], case: str) -> Path:
    from transformers import AutoTokenizer

    model, _, prompt_tokens, steps, _ = CASES[case]
    path = workdir / "data" / f"dpo_{case}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    records = assets.read("pref_train")[:BATCH * steps]
    tok = AutoTokenizer.from_pretrained(models[model])
    out = []
    for i, r in enumerate(records):
        question = r["prompt"] if not prompt_tokens else long_prompt(tok, prompt_tokens - 8, i) + " " + r["prompt"]
        out.append({"prompt": f"User: {question}\nAssistant: ", "chosen": r["chosen"], "rejected": r["rejected"]})
    path.write_text("".join(json.dumps(r) + "\n" for r in out))
    return path


def step_floor(limit: machine_limit.Limit, model: str, data: Path, max_len: int) -> float:
    """Seconds a step needs at the machine's limit: each pair's prompt once with its chosen and rejected answers,
    forward and backward through the policy and forward through the reference (bench/machine_limit.py)."""
    from transformers import AutoTokenizer

    from rlhfkit.data.tokens import encode

    tok = AutoTokenizer.from_pretrained(limit.models[model])
    shape = machine_limit.model_shape(machine_limit.config_of(limit.models[model]))
    train = forward = 0.0
    tokens = 0
    for r in [json.loads(x) for x in data.read_text().splitlines()][:BATCH]:
        prompt = min(max_len, 1 + len(encode(tok, r["prompt"])))
        answers = [min(max_len - prompt, 1 + len(encode(tok, r[k]))) for k in ("chosen", "rejected")]
        train += machine_limit.shared_prefix_flops(shape, prompt, answers, train=True)
        forward += machine_limit.shared_prefix_flops(shape, prompt, answers, train=False)
        tokens += prompt + sum(answers)
    return train / limit.rate(model, tokens) + forward / limit.rate(model, tokens, "forward")


def child_rlhfkit(model: Path, data: Path, out: Path, max_len: int, steps: int) -> StepClock:
    from rlhfkit.config.base import parse_config
    from rlhfkit.config.preference import DPOConfig
    from rlhfkit.trainers.dpo import DPOTrainer, run_dpo

    clock = StepClock()
    original = DPOTrainer.train_batch

    def timed(self, *args, **kwargs):  # train_batch(micro, started, global_batch)
        metrics = original(self, *args, **kwargs)
        clock.tick()
        return metrics

    DPOTrainer.train_batch = timed
    cfg = parse_config(DPOConfig, [
        "--pretrain", str(model), "--dataset", str(data), "--prompt_key", "prompt", "--chosen_key", "chosen",
        "--rejected_key", "rejected", "--max_len", str(max_len), "--train_batch_size", str(BATCH),
        "--micro_train_batch_size", str(BATCH), "--max_steps", str(steps), "--max_epochs", "1", "--beta", str(BETA),
        "--learning_rate", str(LR), "--lr_warmup_ratio", "0",
        *(["--bf16"] if BF16 else []), *([] if "fsdp2" in EXTRA else ["--zero_stage", "0"]), "--save_path", str(out),
        "--disable_progress_bar", "--logging_steps", "1", "--adam_betas", "0.9", "0.999", *EXTRA], "bench")
    run_dpo(cfg)
    return clock


def child_trl(model_dir: Path, data: Path, out: Path, max_len: int, steps: int) -> StepClock:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    clock = StepClock()

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            clock.tick()

    records = [json.loads(x) for x in data.read_text().splitlines()]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(model_dir)
    args = DPOConfig(output_dir=str(out), per_device_train_batch_size=BATCH, gradient_accumulation_steps=1,
                     max_steps=steps, learning_rate=LR, lr_scheduler_type="constant", max_grad_norm=1.0,
                     logging_steps=1, save_strategy="no", report_to="none", use_cpu=not torch.cuda.is_available(),
                     bf16=BF16, fp16=False,
                     max_length=max_len, gradient_checkpointing=False, disable_tqdm=True, seed=42, beta=BETA,
                     dataloader_num_workers=0)
    trainer = DPOTrainer(model=model, args=args, train_dataset=Dataset.from_list(records), processing_class=tok,
                         callbacks=[Clock()])
    clock.ends = [__import__("time").perf_counter()]
    trainer.train()
    return clock


def main() -> None:
    args = parent_args(__doc__, list(CASES))
    workdir = Path(args.workdir).resolve()
    if args.child:
        case = args.case[0]
        model, max_len, _, steps, _ = CASES[case]
        _, models = build_models(workdir)
        run = child_rlhfkit if args.child == "rlhfkit" else child_trl
        clock = run(models[model], workdir / "data" / f"dpo_{case}.jsonl", workdir / f"dpo_{case}_{args.child}",
                    max_len, steps)
        clock.report()
        return
    started_load = load()
    ensure_trl()
    assets, models = build_models(workdir)
    cases = args.case or list(CASES)
    for case in cases:
        write_data(workdir, assets, models, case)
    sizes = {name: count_params(path) / 1e6 for name, path in models.items()}

    def describe(case: str) -> str:
        model, max_len, prompt_tokens, *_ = CASES[case]
        data = "demo short pairs" if not prompt_tokens else f"~{prompt_tokens}-token prompts"
        return f"{model} ({sizes[model]:.1f}M), {data}, max_len {max_len}"

    settings = (f"Settings: batch {BATCH} pairs (one micro-batch), beta {BETA}, sigmoid loss, reference forward every "
                f"step, fp32, AdamW (fused in both), lr {LR} constant, grad clip 1.0, {args.threads} torch "
                f"threads per process, {args.repeats} interleaved runs per system; step time = median gap between "
                "optimizer-step ends after the warm-up steps.")
    limit = machine_limit.Limit(models, args.threads)
    floors = {case: step_floor(limit, CASES[case][0], workdir / "data" / f"dpo_{case}.jsonl", CASES[case][1])
              for case in cases}
    results = {}
    for case in cases:  # one case at a time, each with its own warm-up; the section is rewritten after each
        results.update(interleaved(Path(__file__), [case], args.repeats, args.threads, CASES[case][4]))
        lines = table(results, describe=describe, floor=lambda case, system, extra: floors[case],
                      threads=args.threads)
        path = write_section("dpo", "DPO step time", [*lines, "", limit.describe()], started_load, settings,
                             Path(args.results) if args.results else None)
    print(f"results: {path}")


if __name__ == "__main__":
    main()
