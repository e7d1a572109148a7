"""Cost curves: step time and peak memory of rlhfkit SFT and DPO against sequence length, model size and world size
(issue 26, Build 3), the numbers users plan with and the data the `--dry_run` step-time estimate
(`rlhfkit/planner/step_time.py`) is checked against.

    nice -n 10 .venv/bin/python bench/cost_curves.py            # measure every point (~15 min), then report
    .venv/bin/python bench/cost_curves.py --report              # redraw from bench/results/cost_curves.json

Every point is one child process training a few steps of random-init Llama models sharing the demo tokenizer:
`tiny` (the demo's shape, 1M parameters), `25m` (bench/common.py) and `135m` (SmolLM2-135M's layer shape: hidden
576, 30 layers, 9 heads, 3 KV heads, on the demo's 2,048-token vocabulary). Each row is filled to `max_len` (a short
prompt and a completion or responses longer than `max_len`, cut to it), so a step's tokens are known exactly. One
torch thread per process (a shared 2-core machine: the steadiest figure; the planner scales its rate by threads).
Step time: median gap between optimizer-step ends after one warm-up step; peak memory: the process's (or each
rank's, summed) peak RSS. The load average is recorded with every point. World-size points run under torchrun
(gloo) with DeepSpeed ZeRO-3 and with `--backend fsdp2`. Results: bench/results/cost_curves.json, .md and the PNG
pictures that `bench/cost_curves_report.py` draws.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import MARK, ROOT, StepClock, build_models, child_env, load, long_prompt, machine, step_times, versions

RESULTS = ROOT / "bench" / "results" / "cost_curves.json"
LR = 1e-4
GRPO_PROMPTS = 4
# (name, trainer, model, max_len, rows per step (SFT samples, DPO pairs), world, backend, steps, threads)
POINTS = [
    *[(f"sft-tiny-{n}", "sft", "tiny", n, 2, 1, "single", 8 if n < 4096 else 4, 1)
      for n in (128, 512, 1024, 2048, 4096, 8192)],  # 256: the 4-row sft-tiny-256 below
    *[(f"dpo-tiny-{n}", "dpo", "tiny", n, 1, 1, "single", 8 if n < 4096 else 4, 1)
      for n in (128, 512, 1024, 2048, 4096)],
    *[(f"sft-{m}-256", "sft", m, 256, 4, 1, "single", 5 if m != "135m" else 3, 1) for m in ("tiny", "25m", "135m")],
    *[(f"sft-25m-{n}", "sft", "25m", n, 2, 1, "single", 4, 1) for n in (128, 512, 1024, 2048)],
    *[(f"dpo-{m}-256", "dpo", m, 256, 2, 1, "single", 5 if m != "135m" else 3, 1) for m in ("tiny", "25m", "135m")],
    *[(f"dpo-25m-{n}", "dpo", "25m", n, 1, 1, "single", 4, 1) for n in (128, 1024)],
    ("sft-25m-256-t2", "sft", "25m", 256, 4, 1, "single", 5, 2),
    ("sft-25m-1024-t2", "sft", "25m", 1024, 2, 1, "single", 4, 2),
    ("dpo-25m-256-t2", "dpo", "25m", 256, 2, 1, "single", 5, 2),
    ("sft-tiny-2048-t2", "sft", "tiny", 2048, 2, 1, "single", 8, 2),
    ("sft-25m-128-w1-single", "sft", "25m", 128, 8, 1, "single", 4, 1),
    *[(f"sft-25m-128-w{w}-{b}", "sft", "25m", 128, 8, w, b, 4, 1) for b in ("zero3", "fsdp2") for w in (1, 2)],
    *[(f"dpo-25m-128-w2-{b}", "dpo", "25m", 128, 4, 2, b, 4, 1) for b in ("zero3", "fsdp2")],
    # GRPO through train_ppo (bench/grpo.py's workload): GRPO_PROMPTS prompts x n samples of 32 new tokens a step
    *[(f"grpo-{m}-n{n}", "grpo", m, 96, GRPO_PROMPTS * n, 1, "single", 4, 1) for m, ns in (("tiny", (2, 4, 8, 16)),
                                                                                      ("25m", (4,))) for n in ns],
]


def models(workdir: Path) -> dict[str, Path]:
    """tiny and 25m from bench/common.py with max_position_embeddings 8192 (RoPE: no weights depend on it), and
    the 135M-shaped model."""
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    from rlhfkit.demo.assets import tiny_llama_config

    _, base = build_models(workdir)
    out = {}
    for name, src in base.items():
        dst = workdir / f"curves_{name}"
        if not dst.is_dir():
            shutil.copytree(src, dst)
        config = json.loads((dst / "config.json").read_text())
        config["max_position_embeddings"] = 8192
        (dst / "config.json").write_text(json.dumps(config, indent=2))
        out[name] = dst
    big = workdir / "curves_135m"
    if not (big / "model.safetensors").is_file():
        tok = AutoTokenizer.from_pretrained(base["tiny"])
        config = tiny_llama_config(len(tok), tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, hidden_size=576,
                                   intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                                   num_key_value_heads=3, head_dim=64, max_position_embeddings=8192)
        torch.manual_seed(0)
        LlamaForCausalLM(config).save_pretrained(big)
        tok.save_pretrained(big)
    out["135m"] = big
    return out


def write_data(workdir: Path, model: Path, trainer: str, max_len: int, rows: int, steps: int) -> Path:
    """rows x steps records whose completion (SFT) or both responses (DPO) run past max_len; GRPO: bench/grpo.py's
    prompts."""
    from transformers import AutoTokenizer

    if trainer == "grpo":
        import grpo

        return grpo.write_prompts(workdir, build_models(workdir, big=False)[0])

    tok = AutoTokenizer.from_pretrained(model)
    path = workdir / "data" / f"curves_{trainer}_{max_len}_{rows * steps}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    out = []
    for i in range(rows * steps):
        prompt = f"User: {long_prompt(tok, 8, i)}\nAssistant: "
        if trainer == "sft":
            out.append({"prompt": prompt, "completion": long_prompt(tok, max_len + 16, 1000 + i)})
        else:
            out.append({"prompt": prompt, "chosen": long_prompt(tok, max_len + 16, 2000 + i),
                        "rejected": long_prompt(tok, max_len + 16, 3000 + i)})
    path.write_text("".join(json.dumps(r) + "\n" for r in out))
    return path


def child(trainer: str, backend: str, model: str, data: str, max_len: int, rows: int, steps: int, out: str) -> None:
    """Train `steps` steps of `rows` samples (SFT) or pairs (DPO) per step, one micro-batch per rank."""
    from rlhfkit.config.base import parse_config

    if trainer == "grpo":
        return grpo_child(Path(model), Path(data), rows, steps, Path(out))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    flags = {"single": ["--zero_stage", "0"], "zero3": ["--zero_stage", "3"], "fsdp2": ["--backend", "fsdp2"]}
    common = ["--pretrain", model, "--dataset", data, "--max_len", str(max_len), "--train_batch_size", str(rows),
              "--micro_train_batch_size", str(rows // world), "--max_steps", str(steps), "--max_epochs", "1",
              "--learning_rate", str(LR), "--lr_warmup_ratio", "0", "--save_path", out, "--disable_progress_bar",
              "--logging_steps", "1", *flags[backend]]
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
    clock.extra["kernel"] = linears_kernel()
    clock.report()


def linears_kernel() -> str:
    """The fp32 GEMM kernel this process's linear layers ran on (load_causal_lm's decision, cached per thread count:
    asking again does not probe again)."""
    from rlhfkit.models.cpu_gemm import onednn_faster

    return "onednn" if onednn_faster() else "aten"


def grpo_child(model: Path, prompts: Path, completions: int, steps: int, out: Path) -> None:
    """bench/grpo.py's rlhfkit child (train_ppo) with GRPO_PROMPTS prompts and completions / GRPO_PROMPTS samples
    each, trained in one micro-batch."""
    import grpo

    grpo.PROMPTS, grpo.SAMPLES, grpo.MICRO = GRPO_PROMPTS, completions // GRPO_PROMPTS, completions
    clock = grpo.child_rlhfkit(model, prompts, out, steps)
    clock.extra["kernel"] = linears_kernel()
    clock.report()


def measure(point: tuple, model_dirs: dict[str, Path], workdir: Path) -> dict:
    """Run one point (a process, or a torchrun world) and return its figures."""
    name, trainer, model, max_len, rows, world, backend, steps, threads = point
    data = write_data(workdir, model_dirs[model], trainer, max_len, rows, steps)
    args = [str(Path(__file__)), "--child", trainer, backend, str(model_dirs[model]), str(data), str(max_len),
            str(rows), str(steps), str(workdir / f"curves_run_{name}")]
    cmd = [sys.executable, *args]
    if backend != "single":
        from rlhfkit.distributed.launch import free_port

        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world), "--master_addr",
               "127.0.0.1", "--master_port", str(free_port()), *args]
    env = child_env("rlhfkit", threads)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "bench")])
    load_before, started = load(), time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200, cwd=ROOT)
    # a rank's line may follow another rank's unterminated output: take the mark wherever it starts
    ranks = [json.loads(x[x.index(MARK) + len(MARK):]) for x in proc.stdout.splitlines() if MARK in x]
    if proc.returncode != 0 or len(ranks) != world:
        raise RuntimeError(f"{name} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return {"name": name, "trainer": trainer, "model": model, "max_len": max_len, "rows": rows, "world": world,
            "backend": backend, "steps": steps, "threads": threads, "kernel": ranks[0].get("kernel", "aten"),
            "step_s": max(statistics.median(step_times(r["ends"], 1)) for r in ranks),
            "cpu_s": max(statistics.median(step_times(r["cpu_ends"], 1)) for r in ranks),
            "peak_rss_mb": sum(r["peak_rss_mb"] for r in ranks), "wall_s": time.perf_counter() - started,
            "load_before": load_before, "load_after": load()}


PROBE_CHILD = """
import dataclasses, json, sys, torch
sys.path.insert(0, sys.argv[1])
from rlhfkit.planner.cpu_probe import measure
out = {}
for kernel in ("aten", "onednn"):
    for threads in (1, 2):
        torch.set_num_threads(threads)
        probe = measure(kernel)
        if probe is not None:
            out.setdefault(kernel, {})[str(threads)] = dataclasses.asdict(probe)
print(json.dumps(out))
"""


def machine_probes(processes: int = 5) -> dict[str, dict[str, dict[str, float]]]:
    """rlhfkit/planner/cpu_probe.py's probes of this machine, per GEMM kernel and thread count (1 and 2): what
    `--dry_run` scales the planner's rates by, recorded so the report predicts each point as `--dry_run` would.
    The median of `processes` fresh processes, field by field: on a shared VM one process's probes can all come out
    20% slow or fast together."""
    command = [sys.executable, "-c", PROBE_CHILD, str(ROOT)]
    runs = [json.loads(subprocess.run(command, env=child_env("rlhfkit", 2), check=True, capture_output=True,
                                      text=True).stdout.splitlines()[-1]) for _ in range(processes)]
    return {kernel: {threads: {field: statistics.median(run[kernel][threads][field] for run in runs)
                               for field in probe}
                     for threads, probe in by_threads.items()}
            for kernel, by_threads in runs[0].items()}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        a = sys.argv[2:]
        child(a[0], a[1], a[2], a[3], int(a[4]), int(a[5]), int(a[6]), a[7])
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", default=str(ROOT / "runs" / "bench"))
    p.add_argument("--only", action="append", help="point names to (re)measure (default: all)")
    p.add_argument("--report", action="store_true", help="only redraw the pictures and tables from the JSON")
    p.add_argument("--results", default=str(RESULTS), help="the JSON to write (and read with --only, --report)")
    args = p.parse_args()
    results = Path(args.results).resolve()
    if not args.report:
        workdir = Path(args.workdir).resolve()
        model_dirs = models(workdir)
        configs = {name: json.loads((path / "config.json").read_text()) for name, path in model_dirs.items()}
        old = json.loads(results.read_text()) if results.is_file() and args.only else {"points": []}
        probes = old.get("probes") or machine_probes()
        done = {r["name"]: r for r in old["points"] if not args.only or r["name"] not in args.only}
        for point in POINTS:
            if args.only and point[0] not in args.only:
                continue
            done[point[0]] = measure(point, model_dirs, workdir)
            print(json.dumps(done[point[0]]), flush=True)
            results.write_text(json.dumps({"machine": machine(), "versions": versions(),
                                           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                           "models": configs, "probes": probes, "points": list(done.values())},
                                          indent=1))
    sys.path.insert(0, str(ROOT))  # the planner of this checkout (an editable install may point at another)
    from cost_curves_report import report

    report(results)


if __name__ == "__main__":
    main()
