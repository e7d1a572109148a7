"""`rlhfkit demo` (`make demo`): the whole pipeline on the embedded tiny model and task data, offline.

Stages: build the assets, SFT on the task data, and report held-out exact-match before and after each stage.
Everything goes under --out; the report is `<out>/report.md`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from rlhfkit.cli.common import quiet_libraries, run_cli

PROG = "rlhfkit demo"


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__)
    p.add_argument("--out", default="runs/demo", help="output directory for assets, models, metrics, report")
    p.add_argument("--seed", type=int, default=0, help="seed for assets and training")
    p.add_argument("--sft_steps", type=int, default=800, help="SFT optimizer steps")
    p.add_argument("--eval_samples", type=int, default=200, help="held-out prompts for exact-match")
    return p.parse_args(argv)


def _exact_match(model_dir: str, records: list[dict], n: int) -> float:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhfkit.demo.evaluate import exact_match

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    return exact_match(model, tok, records[:n])


def _read_jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def run_sft_stage(assets, out: Path, steps: int, seed: int) -> str:
    from rlhfkit.config.base import parse_config
    from rlhfkit.config.sft import SFTConfig
    from rlhfkit.demo.assets import DEMO_INPUT_TEMPLATE
    from rlhfkit.trainers.sft import run_sft

    batch = 32
    save = out / "sft"
    n_train = sum(1 for _ in open(assets.sft_train))
    epochs = -(-steps * batch // n_train)  # enough passes for `steps` optimizer steps
    cfg = parse_config(SFTConfig, [
        "--pretrain", str(assets.model_dir), "--dataset", str(assets.sft_train),
        "--eval_dataset", str(assets.sft_eval), "--input_key", "question", "--output_key", "response",
        "--input_template", DEMO_INPUT_TEMPLATE, "--max_len", "64", "--train_batch_size", str(batch),
        "--micro_train_batch_size", str(batch), "--max_epochs", str(epochs), "--max_steps", str(steps),
        "--learning_rate", "1e-3", "--lr_warmup_ratio", "0.05", "--zero_stage", "0", "--seed", str(seed),
        "--save_path", str(save), "--logging_steps", "10", "--eval_steps", "-1", "--adam_betas", "0.9", "0.98",
    ], "demo")
    run_sft(cfg)
    return str(save)


def run_preference_stages(out: Path, seed: int) -> list[str]:
    """RM and DPO on the embedded `max`-task preference pairs; returns report table rows.

    The preference stages use pairs of the `max` task: the default mix is mostly addition, where telling a right
    sum from a wrong one needs arithmetic the raw 1M-parameter model does not have (accuracy plateaus near 0.65).
    """
    from rlhfkit.config.base import parse_config
    from rlhfkit.config.preference import DPOConfig, RMConfig
    from rlhfkit.demo.assets import DEMO_INPUT_TEMPLATE, build_preference_assets
    from rlhfkit.models.loading import load_tokenizer
    from rlhfkit.models.value_model import load_value_model
    from rlhfkit.trainers.dpo import run_dpo
    from rlhfkit.trainers.reward import preference_accuracy, run_rm

    assets = build_preference_assets(out / "assets_preference", seed=seed)
    held_out = _read_jsonl(str(assets.pref_eval))
    common = ["--pretrain", str(assets.model_dir), "--dataset", str(assets.pref_train), "--eval_dataset",
              str(assets.pref_eval), "--prompt_key", "prompt", "--input_template", DEMO_INPUT_TEMPLATE,
              "--max_len", "64", "--train_batch_size", "16", "--micro_train_batch_size", "16", "--zero_stage", "0",
              "--packing_samples", "--logging_steps", "4", "--seed", str(seed)]
    tok = load_tokenizer(str(assets.model_dir))
    rm_before = preference_accuracy(load_value_model(str(assets.model_dir)), held_out, tok,
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
    quiet_libraries()
    args = _parse(argv)
    import torch

    torch.set_num_threads(1)  # one thread: measured faster than two on the shared 2-core machines
    from rlhfkit.demo.assets import build_demo_assets

    out = Path(args.out).resolve()
    started = time.time()
    assets = build_demo_assets(out / "assets", seed=args.seed)
    eval_records = [r for r in _read_jsonl(str(assets.sft_eval)) if r.get("task") == "addition"]
    eval_records = [{"prompt": r["question"], "answer": r["response"], "task": r["task"]} for r in eval_records]
    print(f"[demo] assets in {assets.root}")
    before = _exact_match(str(assets.model_dir), eval_records, args.eval_samples)
    print(f"[demo] held-out addition exact-match before SFT: {before:.3f}")
    sft_dir = run_sft_stage(assets, out, args.sft_steps, args.seed)
    after = _exact_match(sft_dir, eval_records, args.eval_samples)
    print(f"[demo] held-out addition exact-match after SFT:  {after:.3f}")
    preference_rows = run_preference_stages(out, args.seed)
    lines = [
        "# rlhfkit demo report", "",
        "| stage, held-out metric | before | after |", "| --- | --- | --- |",
        f"| SFT, addition exact-match | {before:.3f} | {after:.3f} |", *preference_rows, "",
        f"SFT model: `{sft_dir}`  ", f"SFT metrics: `{sft_dir}/metrics.jsonl`  ",
        f"Total time: {time.time() - started:.0f} s",
    ]
    report = out / "report.md"
    report.write_text("\n".join(lines) + "\n")
    print(f"[demo] done in {time.time() - started:.0f} s")
    print(f"[demo] SFT model:   {sft_dir}")
    print(f"[demo] metrics:     {sft_dir}/metrics.jsonl")
    print(f"[demo] report:      {report}")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main, prog=PROG))
