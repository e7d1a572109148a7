"""SFT step time, rlhfkit (`run_sft`, what `python -m rlhfkit.cli.train_sft` runs) vs TRL 1.16.0 `SFTTrainer`.

Same model, data, batch (16 samples, one micro-batch), max_len, fp32, AdamW, gradient clipping 1.0, no gradient
checkpointing, no packing, loss on the answer tokens only. Cases: the demo model and a ~25M-parameter random-init
Llama on the demo's short question/answer records, the 25M model on prompts of about 104 and 488 tokens
(max_len 128 and 512), and the 25M model on rows that are nearly all completion (`25m-128c`: 16 x ~128 tokens, a
short question (~10% of the row) and a ~104-token answer; `25m-512c`: a ~488-token answer; the compute-bound
cases: nearly every position is trained, so no implementation can skip much of the LM head or the last layer).
Each case's step is also given as a fraction of the machine's limit (bench/machine_limit.py: the model FLOPs over
the machine's measured fp32 GEMM rate on the model's shapes).

    .venv/bin/python bench/sft.py [--case 25m-512] [--repeats 2] [--threads 2]

--threads sets OMP_NUM_THREADS and torch's thread count of every child (default: the machine's cores; the issue's
figures are at 1 and at 2 threads per process).
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

BATCH = 16
EXTRA: list[str] = []  # more rlhfkit flags for the rlhfkit child (bench/gpu: --backend fsdp2)
LR = 1e-4
BF16 = False  # the GPU suite (bench/gpu/suite.py) sets it
# case: (model, max_len, prompt tokens (0: the demo's short questions), steps, warm-up steps)
CASES = {"tiny-short": ("tiny", 128, 0, 12, 2), "25m-short": ("25m", 128, 0, 6, 2),
         "25m-128": ("25m", 128, 104, 4, 1), "25m-128c": ("25m", 128, 104, 4, 1), "25m-512": ("25m", 512, 488, 3, 1),
         "25m-512c": ("25m", 512, 488, 3, 1)}
COMPLETION_HEAVY = {"25m-128c", "25m-512c"}  # their long text is the answer, not the prompt
SHORT_QUESTION = {"25m-128c"}  # the question cut to its first two words: the prompt is ~10% of a 128-token row


def write_data(workdir: Path, assets, models: dict[str, Path], case: str) -> Path:
    from transformers import AutoTokenizer

    model, _, prompt_tokens, steps, _ = CASES[case]
    path = workdir / "data" / f"sft_{case}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    records = assets.read("sft_train")[:BATCH * steps]
    tok = AutoTokenizer.from_pretrained(models[model])
    out = []
    for i, r in enumerate(records):
        question, answer = r["question"], r["response"]
        if case in SHORT_QUESTION:
            question = " ".join(question.split()[:2])
        if case in COMPLETION_HEAVY:
            answer = long_prompt(tok, prompt_tokens, i) + " " + answer
        elif prompt_tokens:
            question = long_prompt(tok, prompt_tokens - 8, i) + " " + question
        out.append({"prompt": f"User: {question}\nAssistant: ", "completion": answer})
    path.write_text("".join(json.dumps(r) + "\n" for r in out))
    return path


def step_flops(model_dir: Path, data: Path, max_len: int) -> tuple[float, int]:
    """Model FLOPs of one step (PaLM: every token of every row trained, bench/machine_limit.py) and its tokens."""
    from transformers import AutoTokenizer

    from rlhfkit.data.tokens import encode

    tok = AutoTokenizer.from_pretrained(model_dir)
    rows = [json.loads(x) for x in data.read_text().splitlines()][:BATCH]
    lengths = [min(max_len, 2 + len(encode(tok, r["prompt"])) + len(encode(tok, r["completion"]))) for r in rows]
    shape = machine_limit.model_shape(machine_limit.config_of(model_dir))
    return machine_limit.train_flops(shape, lengths), sum(lengths)


def child_rlhfkit(model: Path, data: Path, out: Path, max_len: int, steps: int) -> StepClock:
    from rlhfkit.config.base import parse_config
    from rlhfkit.config.sft import SFTConfig
    from rlhfkit.trainers.sft import SFTTrainer, run_sft

    clock = StepClock()
    original = SFTTrainer.train_batch

    def timed(self, *args, **kwargs):  # train_batch(micro, started, global_batch)
        metrics = original(self, *args, **kwargs)
        clock.tick()
        return metrics

    SFTTrainer.train_batch = timed
    cfg = parse_config(SFTConfig, [
        "--pretrain", str(model), "--dataset", str(data), "--input_key", "prompt", "--output_key", "completion",
        # the records' prompts already read "User: ...\nAssistant: ", as TRL gets them: no second template around them
        # (train_sft's default --input_template would add ~7 tokens a row that TRL's rows do not have)
        "--input_template", "",
        "--max_len", str(max_len), "--train_batch_size", str(BATCH), "--micro_train_batch_size", str(BATCH),
        "--max_steps", str(steps), "--max_epochs", "1", "--learning_rate", str(LR), "--lr_warmup_ratio", "0",
        *(["--bf16"] if BF16 else []), *([] if "fsdp2" in EXTRA else ["--zero_stage", "0"]), "--save_path", str(out),
        "--disable_progress_bar",
        "--logging_steps", "1",
        "--adam_betas", "0.9", "0.999", *EXTRA], "bench")
    run_sft(cfg)
    return clock


def child_trl(model_dir: Path, data: Path, out: Path, max_len: int, steps: int) -> StepClock:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    clock = StepClock()

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            clock.tick()

    records = [json.loads(x) for x in data.read_text().splitlines()]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(model_dir)
    args = SFTConfig(output_dir=str(out), per_device_train_batch_size=BATCH, gradient_accumulation_steps=1,
                     max_steps=steps, learning_rate=LR, lr_scheduler_type="constant", max_grad_norm=1.0,
                     logging_steps=1, save_strategy="no", report_to="none", use_cpu=not torch.cuda.is_available(),
                     bf16=BF16, fp16=False,
                     max_length=max_len, gradient_checkpointing=False, packing=False, disable_tqdm=True, seed=42,
                     dataloader_num_workers=0, completion_only_loss=True)
    trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(records), processing_class=tok,
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
        clock = run(models[model], workdir / "data" / f"sft_{case}.jsonl", workdir / f"sft_{case}_{args.child}",
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
        data = "demo short Q/A" if not prompt_tokens else f"~{prompt_tokens}-token prompts"
        data = f"~{prompt_tokens}-token answers (compute-bound)" if case in COMPLETION_HEAVY else data
        return f"{model} ({sizes[model]:.1f}M), {data}, max_len {max_len}"

    settings = (f"Settings: batch {BATCH} (one micro-batch), fp32, AdamW (fused in both), lr {LR} constant, grad "
                f"clip 1.0, loss on answer tokens, no packing, no gradient checkpointing, {args.threads} torch "
                f"threads per process, {args.repeats} interleaved runs per system; step time = median gap between "
                "optimizer-step ends after the warm-up steps.")
    limit, floors = machine_limit.Limit(models, args.threads), {}
    for case in cases:
        model, max_len, *_ = CASES[case]
        flops, tokens = step_flops(models[model], workdir / "data" / f"sft_{case}.jsonl", max_len)
        floors[case] = flops / limit.rate(model, tokens)
    results = {}
    for case in cases:  # one case at a time, each with its own warm-up; the section is rewritten after each
        results.update(interleaved(Path(__file__), [case], args.repeats, args.threads, CASES[case][4]))
        lines = table(results, describe=describe, floor=lambda case, system, extra: floors[case],
                      threads=args.threads)
        path = write_section("sft", "SFT step time", [*lines, "", limit.describe()], started_load, settings,
                             Path(args.results) if args.results else None)
    print(f"results: {path}")


if __name__ == "__main__":
    main()
