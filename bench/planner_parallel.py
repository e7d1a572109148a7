"""The `--dry_run` planner against measured peak RSS per rank for the parallel layouts (issue 20, acceptance 7): SFT
on the ~25M-parameter Llama at world 2 (torchrun, gloo, CPU) with `--backend fsdp2` and with sequence parallelism
(`--ring_attn_size 2`), fp32, 8 samples of up to 128 tokens per rank and step.

    .venv/bin/python bench/planner_parallel.py [--steps 3]
    .venv/bin/python bench/planner_parallel.py --long   # acceptance 3's 32k-token sample on 4 ranks

`--long`: one 32k-token sample per step through the demo model's shape (1M parameters; max_position_embeddings
raised to 32768) on 4 ranks with `--ring_attn_size 4` (FSDP2, fp32), after the planner's verdicts for a budget of
LONG_BUDGET_GB per device: the whole sample on 1 rank does not fit, split over 4 ranks it does.

Predicted: the CPU plan's largest process (the measured per-process baseline plus one rank's rows, the same
numbers `--dry_run` prints on a machine without GPUs) for the same flags at world size 2. Measured: each rank's own
peak (VmHWM, `common.peak_rss_mb`) at the end of the run, the larger of the two. Results:
bench/results/planner_parallel.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

from common import MARK, ROOT, build_models, child_env, filler_words, load, machine, peak_rss_mb, versions

BATCH, MAX_LEN = 16, 128
LONG_TOKENS, LONG_BUDGET_GB, LONG_RANKS = 32768, 1.5, 4
LAYOUTS = {"FSDP2": ["--backend", "fsdp2"],
           "DeepSpeed ZeRO-2, --ring_attn_size 2": ["--ring_attn_size", "2"],
           "FSDP2, --ring_attn_size 2": ["--backend", "fsdp2", "--ring_attn_size", "2"]}


def write_full_rows(workdir: Path) -> Path:
    """BATCH x 4 SFT records whose responses run past MAX_LEN tokens (cut there), so every row of a micro-batch is
    MAX_LEN tokens long, as the plan assumes (short demo records would pad only to the batch's longest)."""
    data = workdir / "data" / "planner_parallel_sft.jsonl"
    data.parent.mkdir(parents=True, exist_ok=True)
    data.write_text("".join(json.dumps({"prompt": "User: go on\nAssistant: ", "completion": filler_words(200, s)})
                            + "\n" for s in range(BATCH * 4)))
    return data


def sft_argv(model: Path, data: Path, out: Path, steps: int, layout: list[str]) -> list[str]:
    return ["--pretrain", str(model), "--dataset", str(data), "--input_key", "prompt", "--output_key", "completion",
            "--max_len", str(MAX_LEN), "--train_batch_size", str(BATCH), "--micro_train_batch_size", str(BATCH // 2),
            "--max_steps", str(steps), "--max_epochs", "1", "--learning_rate", "1e-4", "--lr_warmup_ratio", "0",
            "--param_dtype", "fp32", "--save_path", str(out), "--disable_progress_bar", *layout]


def child(argv: list[str]) -> None:
    """One rank: train, then report this rank's peak RSS."""
    from rlhfkit.config.base import parse_config
    from rlhfkit.config.sft import SFTConfig
    from rlhfkit.trainers.sft import run_sft

    run_sft(parse_config(SFTConfig, argv, "bench"))
    peak = peak_rss_mb()
    print(MARK + json.dumps({"rank": int(os.environ.get("RANK", "0")), "peak_rss_mb": peak}), flush=True)


def predicted_mib(argv: list[str], world: int) -> float:
    """The CPU plan's largest process for `argv` at `world` ranks, in MiB."""
    from rlhfkit.config.base import parse_config
    from rlhfkit.config.sft import SFTConfig
    from rlhfkit.planner.memory import MIB
    from rlhfkit.planner.plan import Devices, build_plan

    os.environ["WORLD_SIZE"] = str(world)  # the tensor-parallel rule reads the launcher's world size
    cfg = parse_config(SFTConfig, [*argv, "--dry_run"], "bench")
    plan = build_plan(cfg, "sft", Devices("cpu", 64.0 * 1024**3, 1, "bench"), world)
    return max(p.largest_process for p in plan.pools) / MIB


def measure(argv: list[str], world: int, threads: int) -> float:
    from rlhfkit.distributed.launch import free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world), "--master_addr",
           "127.0.0.1", "--master_port", str(free_port()), str(Path(__file__)), "--child", json.dumps(argv)]
    env = child_env("rlhfkit", threads)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "bench")])
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600, cwd=ROOT)
    ranks = [json.loads(x[len(MARK):]) for x in proc.stdout.splitlines() if x.startswith(MARK)]
    if proc.returncode != 0 or len(ranks) != world:
        raise RuntimeError(f"failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return max(r["peak_rss_mb"] for r in ranks)


def long_model_and_data(workdir: Path, assets) -> tuple[Path, Path]:
    """The demo model's shape with room for LONG_TOKENS positions (random init, the demo tokenizer) and two SFT
    records whose responses run past LONG_TOKENS tokens (cut there by --max_len)."""
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    from rlhfkit.demo.assets import tiny_llama_config

    model_dir, data = workdir / "tiny32k", workdir / "data" / "long32k.jsonl"
    tok = AutoTokenizer.from_pretrained(assets.model_dir)
    if not (model_dir / "model.safetensors").is_file():
        config = tiny_llama_config(len(tok), tok.bos_token_id, tok.eos_token_id, tok.pad_token_id,
                                   max_position_embeddings=LONG_TOKENS)
        torch.manual_seed(0)
        LlamaForCausalLM(config).save_pretrained(model_dir)
        tok.save_pretrained(model_dir)
    words = 4096
    while len(tok(filler_words(words, 0))["input_ids"]) <= LONG_TOKENS:
        words *= 2
    data.parent.mkdir(parents=True, exist_ok=True)
    data.write_text("".join(json.dumps({"prompt": "User: go on\nAssistant: ", "completion": filler_words(words, s)})
                            + "\n" for s in (1, 2)))
    return model_dir, data


def verdict(argv: list[str], world: int) -> list[str]:
    """The verdict line (and advice) `--dry_run --dry_run_gpu_memory_gb LONG_BUDGET_GB` prints at `world`."""
    from rlhfkit.config.base import parse_config
    from rlhfkit.config.sft import SFTConfig
    from rlhfkit.planner.advice import plan_with_advice, render
    from rlhfkit.planner.memory import GIB
    from rlhfkit.planner.plan import Devices

    os.environ["WORLD_SIZE"] = str(world)
    cfg = parse_config(SFTConfig, [*argv, "--dry_run", "--dry_run_gpu_memory_gb", str(LONG_BUDGET_GB)], "bench")
    text = render(plan_with_advice(cfg, "sft", Devices("gpu", LONG_BUDGET_GB * GIB, world, "budget"), world), "x")
    return [line.strip() for line in text.splitlines() if line.startswith(("verdict", "  "))
            and ("verdict" in line or "ring_attn_size" in line)]


def run_long(workdir: Path, assets, threads: int, results: Path) -> None:
    started = load()
    model, data = long_model_and_data(workdir, assets)
    base = ["--pretrain", str(model), "--dataset", str(data), "--input_key", "prompt", "--output_key", "completion",
            "--max_len", str(LONG_TOKENS), "--train_batch_size", "1", "--micro_train_batch_size", "1",
            "--max_steps", "2", "--max_epochs", "1", "--learning_rate", "1e-4", "--lr_warmup_ratio", "0",
            "--param_dtype", "fp32", "--save_path", str(workdir / "long32k"), "--disable_progress_bar",
            "--backend", "fsdp2"]
    ring = [*base, "--ring_attn_size", str(LONG_RANKS)]
    one, split = verdict(base, 1), verdict(ring, LONG_RANKS)
    predicted = predicted_mib(ring, LONG_RANKS)
    clock = datetime.datetime.now()
    measured = measure(ring, LONG_RANKS, threads)
    seconds = (datetime.datetime.now() - clock).total_seconds()
    text = ["# A 32k-token sample on 4 ranks with sequence parallelism (bench/planner_parallel.py --long)", "",
            f"Run {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC. Machine: {machine()}; "
            f"{versions()}. Load average at start {started}, at end {load()}.", "",
            f"Model: the demo Llama's shape (hidden 128, 4 layers, 4 query / 2 KV heads, vocab 2048, about 1M "
            f"parameters) with max_position_embeddings {LONG_TOKENS}, random init. train_sft, 2 steps of one "
            f"{LONG_TOKENS}-token sample (prompt + response cut at --max_len), FSDP2, fp32, {threads} torch "
            f"thread(s) per rank, gloo.", "",
            f"Planner, budget `--dry_run_gpu_memory_gb {LONG_BUDGET_GB}`:", "",
            "- 1 rank, the whole sample: " + "; ".join(f"`{x}`" for x in one),
            f"- {LONG_RANKS} ranks, `--ring_attn_size {LONG_RANKS}`: " + "; ".join(f"`{x}`" for x in split), "",
            f"Trained on {LONG_RANKS} ranks (`--ring_attn_size {LONG_RANKS}`): 2 steps in {seconds:.0f} s wall "
            f"(start-up included); peak RSS per rank {measured:.0f} MiB measured, {predicted:.0f} MiB predicted by "
            f"the CPU plan (ratio {predicted / measured:.2f}).", ""]
    results.write_text("\n".join(text))
    print("\n".join(text))


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(json.loads(sys.argv[2]))
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", default=str(ROOT / "runs" / "bench"))
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--results", default=str(ROOT / "bench" / "results" / "planner_parallel.md"))
    p.add_argument("--long", action="store_true", help="the 32k-token sample on 4 ranks instead")
    args = p.parse_args()
    workdir = Path(args.workdir).resolve()
    started = load()
    if args.long:
        assets, _ = build_models(workdir, big=False)
        run_long(workdir, assets, args.threads, ROOT / "bench" / "results" / "planner_long_context.md")
        return
    assets, models = build_models(workdir)
    data = write_full_rows(workdir)
    rows = ["| layout (world 2) | predicted MiB/rank | measured peak RSS MiB/rank | predicted / measured |",
            "| --- | --- | --- | --- |"]
    for name, layout in LAYOUTS.items():
        argv = sft_argv(models["25m"], data, workdir / "planner_parallel", args.steps, layout)
        predicted, measured = predicted_mib(argv, 2), measure(argv, 2, args.threads)
        rows.append(f"| {name} | {predicted:.0f} | {measured:.0f} | **{predicted / measured:.2f}** |")
        print(rows[-1], f"load {load()}", flush=True)
    text = ["# The memory planner vs measured peak RSS, parallel layouts (bench/planner_parallel.py)", "",
            f"Run {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC. Machine: {machine()}; "
            f"{versions()}. Load average (1/5/15 min) at start {started}, at end {load()}.", "",
            f"Settings: train_sft on the 25M-parameter Llama (bench/common.py), world 2 (torchrun, gloo), {BATCH} "
            f"samples per step (8 per rank, one micro-batch), every row {MAX_LEN} tokens (filler text cut at "
            f"max_len), fp32, AdamW, {args.steps} steps, "
            f"{args.threads} torch thread(s) per rank. Predicted: the CPU plan's largest process (`--dry_run` "
            "without GPUs); goal: within 25% (0.75-1.25).", "", *rows, ""]
    Path(args.results).write_text("\n".join(text))
    print("\n".join(text))


if __name__ == "__main__":
    main()
