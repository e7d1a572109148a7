"""The `--dry_run` planner against measured peak RSS per rank for the parallel layouts (issue 20, acceptance 7): SFT
on the ~25M-parameter Llama at world 2 (torchrun, gloo, CPU) with `--backend fsdp2` and with sequence parallelism
(`--ring_attn_size 2`), fp32, 8 samples of up to 128 tokens per rank and step.

    .venv/bin/python bench/planner_parallel.py [--steps 3]

Predicted: the CPU plan's largest process (the measured per-process baseline plus one rank's rows, the same
numbers `--dry_run` prints on a machine without GPUs) for the same flags at world size 2. Measured: each rank's own
`ru_maxrss` at the end of the run, the larger of the two. Results: bench/results/planner_parallel.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

from common import MARK, ROOT, build_models, child_env, load, machine, versions
from fsdp2_vs_zero3 import write_data

BATCH, MAX_LEN = 16, 128
LAYOUTS = {"FSDP2": ["--backend", "fsdp2"],
           "DeepSpeed ZeRO-2, --ring_attn_size 2": ["--ring_attn_size", "2"],
           "FSDP2, --ring_attn_size 2": ["--backend", "fsdp2", "--ring_attn_size", "2"]}


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
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
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


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(json.loads(sys.argv[2]))
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", default=str(ROOT / "runs" / "bench"))
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--results", default=str(ROOT / "bench" / "results" / "planner_parallel.md"))
    args = p.parse_args()
    workdir = Path(args.workdir).resolve()
    started = load()
    assets, models = build_models(workdir)
    data = write_data(workdir, assets)["sft"]
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
            f"samples per step (8 per rank, one micro-batch), max_len {MAX_LEN}, fp32, AdamW, {args.steps} steps, "
            f"{args.threads} torch thread(s) per rank. Predicted: the CPU plan's largest process (`--dry_run` "
            "without GPUs); goal: within 25% (0.75-1.25).", "", *rows, ""]
    Path(args.results).write_text("\n".join(text))
    print("\n".join(text))


if __name__ == "__main__":
    main()
