"""Where a step's time goes on the GPU: torch.profiler over two steps of SFT and DPO, rlhfkit (DeepSpeed ZeRO-0 and
`--backend fsdp2`) beside TRL, at the GPU sizes of bench/gpu/suite.py.

The first GPU run (bench/results/gpu.md, 2026-11-27) measured rlhfkit's SFT at 1.98x and DPO at 1.53x TRL's step
time, unexplained. Each stage here is one child process (one system, one workload, one backend) that times its
steps like the suite does and profiles two steps after the warm-up: the tables (self CUDA time and self CPU time per
op, top rows) and a summary line (median step, GPU-busy fraction of the profiled steps, peak GPU memory) go to
--out/profile.log and profile.md. The FSDP2 stages are also issue 20's FSDP2/DeepSpeed comparison on one GPU.

    python bench/gpu/step_profile.py [--smoke] --workdir /tmp/rlhfkit_bench_gpu --out $OUT --budget_s 300
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

import common  # noqa: E402

MARK = "PROFILE_RESULT "
# (system, workload, backend): interleaved so a budget cut loses the end of the list, not a whole system
# A stage is "system,workload,backend[,variants]" with variants joined by "+": nocudnn (SDPA without its cuDNN
# kernel, both systems), plain (rlhfkit without its CPU-tuned forwards: no shared-prompt DPO pass, no re-laid-out
# rows, no trimmed last layer / late LM head).
STAGES = ["rlhfkit,sft,deepspeed", "trl,sft,", "rlhfkit,sft,fsdp2", "rlhfkit,dpo,deepspeed", "trl,dpo,",
          "rlhfkit,dpo,fsdp2"]


def apply_variants(variants: list[str]) -> None:
    import torch

    if "nocudnn" in variants:
        torch.backends.cuda.enable_cudnn_sdp(False)
    if "plain" in variants:
        from rlhfkit.trainers import preference, sft

        preference._shared_prompt_logps = lambda *a, **k: None
        for module in (preference, sft):
            module.dense_rows = lambda model, batch: batch
            module.first_target_position = lambda batch: 0


def child(stage: str, args: argparse.Namespace) -> None:
    """One stage in this process: time every step, profile steps warmup+1 and warmup+2, print tables and a result."""
    system, workload, backend, *rest = stage.split(",")
    apply_variants(rest[0].split("+") if rest else [])
    import dpo
    import sft
    import suite
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available() and not args.smoke
    sizes = suite.GPU if cuda else suite.SMOKE
    if backend == "fsdp2":
        sft.EXTRA = dpo.EXTRA = ["--backend", "fsdp2"]
    steps, warmup = sizes.steps_of(workload)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    prof = profile(activities=activities)
    window: list[float] = []
    original = common.StepClock.tick

    def tick(clock: common.StepClock) -> None:
        original(clock)
        done = len(clock.ends) - 1
        if done == warmup:
            if cuda:
                torch.cuda.synchronize()
            window.append(time.perf_counter())
            prof.start()
        elif done == warmup + 2 and window:
            if cuda:
                torch.cuda.synchronize()
            prof.stop()
            window.append(time.perf_counter())

    common.StepClock.tick = tick  # type: ignore[method-assign]
    model = suite.model_dir(Path(args.workdir), sizes)
    paths = json.loads(args.paths)
    result = suite.run_workload(system, workload, sizes, model, Path(paths[workload]),
                                Path(args.workdir) / "profile_runs" / backend)
    if len(window) == 1:  # the run ended before the second profiled step (a short smoke run)
        prof.stop()
        window.append(time.perf_counter())
    times = result[workload]
    summary = {"stage": stage, "median_step_s": statistics.median(times),
               "steps": len(times), "peak_gib": result[f"{workload}_peak_gib"]}
    if len(window) == 2:
        events = prof.key_averages()
        key = "self_device_time_total" if cuda else "self_cpu_time_total"
        busy = sum(getattr(e, "self_device_time_total", 0) for e in events) / 1e6 if cuda else float("nan")
        summary.update(profiled_s=window[1] - window[0], gpu_busy_s=busy)
        for sort in ([key, "self_cuda_time_total", "self_cpu_time_total"] if cuda else [key])[:2]:
            try:  # torch renamed the CUDA columns "device" (2.4); keep the old name as a fallback
                print(f"##### {summary['stage']}: by {sort}\n"
                      + events.table(sort_by=sort, row_limit=30, max_name_column_width=70))
                break
            except Exception as exc:  # noqa: BLE001 -- a table lost is a line in the log, not the stage
                print(f"##### table by {sort} failed: {exc}")
        if cuda:
            print(f"##### {summary['stage']}: by self_cpu_time_total\n"
                  + events.table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=70))
    print(MARK + json.dumps(summary), flush=True)


def run_stage(stage: str, args: argparse.Namespace, paths: dict, timeout: float, log) -> dict:
    system = stage.split(",")[0]
    cmd = [sys.executable, str(Path(__file__)), "--child", stage, "--workdir", args.workdir,
           "--paths", json.dumps(paths)] + (["--smoke"] if args.smoke else [])
    env = common.child_env("trl" if system == "trl" else "rlhfkit", args.threads)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(HERE.parent), str(HERE), env["PYTHONPATH"],
                                                    os.environ.get("PYTHONPATH")] if p)
    if not args.smoke:
        env.pop("DS_ACCELERATOR", None)
    started = time.monotonic()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=common.ROOT)
        out, err, error = proc.stdout, proc.stderr, "" if proc.returncode == 0 else f"exit {proc.returncode}"
    except subprocess.TimeoutExpired as exc:
        out, err, error = str(exc.stdout or ""), str(exc.stderr or ""), f"killed at {timeout:.0f} s"
    took = time.monotonic() - started
    log.write(f"\n\n======== {stage} ({took:.0f} s) {error}\n{out}\n--- stderr tail ---\n{err[-6000:]}\n")
    log.flush()
    lines = [x for x in out.splitlines() if x.startswith(MARK)]
    result = json.loads(lines[-1][len(MARK):]) if lines else {"stage": stage}
    result.update(wall_s=round(time.monotonic() - started, 1), error=error)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--workdir", default="/tmp/rlhfkit_bench_gpu")
    p.add_argument("--out", default=str(common.ROOT / "runs" / "gpu_out"))
    p.add_argument("--budget_s", type=float, default=0)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--stages", default=";".join(STAGES), help="stages, ';'-separated (see STAGES)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--paths", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args.child, args)
    import suite
    import torch

    deadline = time.monotonic() + (args.budget_s or 1e9)
    sizes = suite.GPU if torch.cuda.is_available() and not args.smoke else suite.SMOKE
    paths, _ = suite.write_data(Path(args.workdir), sizes, suite.model_dir(Path(args.workdir), sizes))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    with open(out / "profile.log", "w") as log:
        for stage in args.stages.split(";"):
            if stage.startswith("trl,") and not (common.TRL_DIR / "trl").is_dir():
                continue
            left = deadline - time.monotonic()
            if left < 45:
                rows.append({"stage": stage, "error": f"not run: {left:.0f} s left"})
                continue
            rows.append(run_stage(stage, args, paths, min(left, 150), log))
            write_summary(out / "profile.md", rows)
    print((out / "profile.md").read_text())


def write_summary(path: Path, rows: list[dict]) -> None:
    lines = ["| stage | median step s | steps | profiled 2 steps s | GPU busy s | peak GPU GiB | wall s | error |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        cells = [r.get("stage"), r.get("median_step_s"), r.get("steps"), r.get("profiled_s"), r.get("gpu_busy_s"),
                 r.get("peak_gib"), r.get("wall_s"), r.get("error", "")]
        lines.append("| " + " | ".join(f"{c:.4g}" if isinstance(c, float) else str(c) for c in cells) + " |")
    path.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
