"""FSDP2 (`--backend fsdp2`) vs DeepSpeed ZeRO-3 at world 2 (torchrun, gloo, CPU): SFT and DPO step time and peak
RSS per rank on the ~25M-parameter Llama (issue 20, acceptance 7). Same data, batch (16 samples per step, 8 per
rank in one micro-batch), fp32, AdamW, clipping 1.0; the runs alternate backends.

    .venv/bin/python bench/fsdp2_vs_zero3.py [--repeats 1] [--threads 1]

Step time: median gap between optimizer-step ends after one warm-up step, the slower rank's; peak RSS: each
rank's own peak (VmHWM, `common.peak_rss_mb`) at the end of the run (the larger of the two ranks). Results:
bench/results/fsdp2_vs_zero3.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from common import MARK, ROOT, StepClock, build_models, child_env, load, machine, step_times, versions

BATCH, STEPS, WARMUP, MAX_LEN, LR = 16, 6, 1, 128, 1e-4
BACKENDS = {"fsdp2": ["--backend", "fsdp2"], "zero3": ["--zero_stage", "3"]}
TRAINERS = ("sft", "dpo")


def write_data(workdir: Path, assets) -> dict[str, Path]:
    """The demo's short records, STEPS batches of each (SFT: question/response, DPO: prompt/chosen/rejected)."""
    out = {"sft": workdir / "data" / "fsdp2_sft.jsonl", "dpo": workdir / "data" / "fsdp2_dpo.jsonl"}
    out["sft"].parent.mkdir(parents=True, exist_ok=True)
    sft = [{"prompt": f"User: {r['question']}\nAssistant: ", "completion": r["response"]}
           for r in assets.read("sft_train")[:BATCH * STEPS]]
    dpo = [{"prompt": f"User: {r['prompt']}\nAssistant: ", "chosen": r["chosen"], "rejected": r["rejected"]}
           for r in assets.read("pref_train")[:BATCH * STEPS]]
    for name, rows in (("sft", sft), ("dpo", dpo)):
        out[name].write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


def child(trainer: str, backend: str, model: Path, data: Path, out: Path) -> None:
    """One rank of a torchrun world of 2: train STEPS steps, report the step ends and this rank's peak RSS."""
    from rlhfkit.config.base import parse_config

    common = ["--pretrain", str(model), "--dataset", str(data), "--max_len", str(MAX_LEN), "--train_batch_size",
              str(BATCH), "--micro_train_batch_size", str(BATCH // 2), "--max_steps", str(STEPS), "--max_epochs",
              "1", "--learning_rate", str(LR), "--lr_warmup_ratio", "0", "--param_dtype", "fp32", "--save_path",
              str(out), "--disable_progress_bar", "--logging_steps", "1", *BACKENDS[backend]]
    if trainer == "sft":
        from rlhfkit.config.sft import SFTConfig
        from rlhfkit.trainers.sft import SFTTrainer as Trainer
        from rlhfkit.trainers.sft import run_sft as run

        cfg = parse_config(SFTConfig, [*common, "--input_key", "prompt", "--output_key", "completion"], "bench")
    else:
        from rlhfkit.config.preference import DPOConfig
        from rlhfkit.trainers.dpo import DPOTrainer as Trainer  # type: ignore[assignment]
        from rlhfkit.trainers.dpo import run_dpo as run  # type: ignore[assignment]

        cfg = parse_config(DPOConfig, [*common, "--prompt_key", "prompt", "--chosen_key", "chosen",
                                       "--rejected_key", "rejected"], "bench")
    clock = StepClock()
    original = Trainer.train_batch

    def timed(self, *args, **kwargs):
        metrics = original(self, *args, **kwargs)
        clock.tick()
        return metrics

    Trainer.train_batch = timed  # type: ignore[method-assign]
    run(cfg)
    clock.extra["rank"] = int(os.environ.get("RANK", "0"))
    clock.report()


def run_pair(trainer: str, backend: str, model: Path, data: Path, workdir: Path, threads: int) -> dict:
    from rlhfkit.distributed.launch import free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), str(Path(__file__)), "--child", trainer, backend, str(model), str(data),
           str(workdir / f"fsdp2_{trainer}_{backend}")]
    env = child_env("rlhfkit", threads)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "bench")])
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800, cwd=ROOT)
    ranks = [json.loads(x[len(MARK):]) for x in proc.stdout.splitlines() if x.startswith(MARK)]
    if proc.returncode != 0 or len(ranks) != 2:
        raise RuntimeError(f"{trainer} {backend} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                           f"{proc.stderr[-5000:]}")
    time = max(statistics.median(step_times(r["ends"], WARMUP)) for r in ranks)
    cpu = max(statistics.median(step_times(r["cpu_ends"], WARMUP)) for r in ranks)
    return {"time": time, "cpu": cpu, "rss": max(r["peak_rss_mb"] for r in ranks)}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        trainer, backend, model, data, out = sys.argv[2:7]
        child(trainer, backend, Path(model), Path(data), Path(out))
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", default=str(ROOT / "runs" / "bench"))
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--results", default=str(ROOT / "bench" / "results" / "fsdp2_vs_zero3.md"))
    args = p.parse_args()
    workdir = Path(args.workdir).resolve()
    started = load()
    assets, models = build_models(workdir)
    data = write_data(workdir, assets)
    rows = ["| trainer | FSDP2 s/step | ZeRO-3 s/step | ratio | FSDP2 CPU s/step | ZeRO-3 CPU s/step | CPU ratio | "
            "FSDP2 peak RSS MB/rank | ZeRO-3 peak RSS MB/rank | RSS ratio |", "| --- " * 10 + "|"]
    for trainer in TRAINERS:
        got: dict[str, list[dict]] = {b: [] for b in BACKENDS}
        for _ in range(args.repeats):
            for backend in BACKENDS:  # alternated, so a change in the machine's load hits both
                got[backend].append(run_pair(trainer, backend, models["25m"], data[trainer], workdir, args.threads))
                print(trainer, backend, got[backend][-1], f"load {load()}", flush=True)
        f, z = ({k: statistics.median(r[k] for r in got[b]) for k in ("time", "cpu", "rss")} for b in BACKENDS)
        rows.append(f"| {trainer} | {f['time']:.3f} | {z['time']:.3f} | **{f['time'] / z['time']:.2f}** | "
                    f"{f['cpu']:.3f} | {z['cpu']:.3f} | **{f['cpu'] / z['cpu']:.2f}** | {f['rss']:.0f} | "
                    f"{z['rss']:.0f} | **{f['rss'] / z['rss']:.2f}** |")
    text = ["# FSDP2 vs DeepSpeed ZeRO-3 at world 2 (bench/fsdp2_vs_zero3.py)", "",
            f"Run {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC. Machine: {machine()}; "
            f"{versions()}. Load average (1/5/15 min) at start {started}, at end {load()} "
            "(a shared machine: wall times are noisy, CPU time per step is the steadier figure).", "",
            f"Settings: 25M-parameter Llama, {BATCH} samples per step (8 per rank, one micro-batch), max_len "
            f"{MAX_LEN}, fp32, AdamW, {STEPS} steps ({WARMUP} warm-up), {args.threads} torch thread(s) per rank, "
            f"{args.repeats} run(s) per backend, gloo. Ratio < 1: FSDP2 faster / smaller.", "", *rows, ""]
    Path(args.results).write_text("\n".join(text))
    print("\n".join(text))


if __name__ == "__main__":
    main()
