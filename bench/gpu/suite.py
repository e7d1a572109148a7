"""The GPU suite: correctness checks of the CUDA paths and SFT / DPO / GRPO side by side with TRL 1.16.0.

Runs with what the GPU machine has (torch, transformers; DeepSpeed and TRL travel as small wheels, see
../shared/PLATFORM.md; no Ray, no vLLM, so RL runs in one process with the Transformers rollout engine):

1. checks, in this process:
   - `bf16_vs_fp32`: a few optimizer steps of the same model on the same batches in fp32 (plain-torch engine) and
     bf16 (DeepSpeed bf16, fp32 master weights) give losses within 5% of each other;
   - `engine_logprobs`: the log-probs the Transformers rollout engine reports for the tokens it sampled match the
     trainer's teacher-forced log-probs of the same tokens (fp32: 1e-4; bf16: 0.1 max, 0.02 mean).
2. comparisons, one child process per system, interleaved: SFT (tokens/s over all non-pad tokens), DPO (pairs/s),
   GRPO (step time), using the children of bench/sft.py, dpo.py and grpo.py at the sizes below. The TRL children
   run only where TRL is importable from bench/.trl (`pip install --no-deps --target bench/.trl trl==1.16.0`).

On a GPU: a random-init Qwen2 shaped like Qwen2.5-0.5B, bf16, SFT 8 x 1024 tokens, DPO 8 pairs of 128+384 tokens,
GRPO 16 prompts x 8 samples x 256 new tokens; results go to bench/results/gpu.md. `--smoke` runs everything on the
CPU at tiny sizes (the demo model, fp32, 2 steps) in about half a minute, for CI; its results go to --workdir.

    python bench/gpu/suite.py [--smoke] [--workdir runs/bench_gpu] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(BENCH))

import common  # noqa: E402


@dataclass
class Sizes:
    model: str  # "tiny" (the demo model) or "qwen05b"
    bf16: bool
    sft_batch: int
    sft_prompt_tokens: int
    sft_max_len: int
    dpo_batch: int
    dpo_prompt_tokens: int
    dpo_max_len: int
    grpo_prompts: int
    grpo_samples: int
    grpo_new_tokens: int
    grpo_micro: int
    steps: int
    warmup: int


SMOKE = Sizes("tiny", False, 4, 16, 48, 2, 16, 48, 2, 2, 4, 4, 2, 1)
GPU = Sizes("qwen05b", True, 8, 1000, 1024, 8, 120, 512, 16, 8, 256, 32, 8, 2)


# -- models and data -----------------------------------------------------------------------------------------------
def model_dir(workdir: Path, sizes: Sizes) -> Path:
    _, models = common.build_models(workdir, big=False)
    if sizes.model == "tiny":
        return models["tiny"]
    path = workdir / "qwen05b"
    if not (path / "config.json").is_file():
        import torch
        from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

        tok = AutoTokenizer.from_pretrained(models["tiny"])
        config = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                             num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=4096,
                             tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                             pad_token_id=tok.pad_token_id)
        torch.manual_seed(0)
        Qwen2ForCausalLM(config).save_pretrained(path)
        tok.save_pretrained(path)
    return path


def write_data(workdir: Path, sizes: Sizes, model: Path) -> dict[str, Path]:
    from transformers import AutoTokenizer

    assets, _ = common.build_models(workdir, big=False)
    tok = AutoTokenizer.from_pretrained(model)
    data = workdir / "data"
    data.mkdir(parents=True, exist_ok=True)
    n = sizes.steps + sizes.warmup + 1

    def prompt(i: int, tokens: int, question: str) -> str:
        return f"User: {common.long_prompt(tok, tokens, i)} {question}\nAssistant: "

    sft = [{"prompt": prompt(i, sizes.sft_prompt_tokens, r["question"]), "completion": r["response"]}
           for i, r in enumerate(assets.read("sft_train")[:sizes.sft_batch * n])]
    dpo = [{"prompt": prompt(i, sizes.dpo_prompt_tokens, r["prompt"]), "chosen": r["chosen"],
            "rejected": r["rejected"]} for i, r in enumerate(assets.read("pref_train")[:sizes.dpo_batch * n])]
    rl = [{"prompt": f"User: {r['prompt']}\nAssistant: ", "answer": r["answer"]}
          for r in assets.read("rl_train")[:sizes.grpo_prompts * n]]
    paths = {}
    for name, records in (("sft", sft), ("dpo", dpo), ("grpo", rl)):
        paths[name] = data / f"gpu_{name}.jsonl"
        paths[name].write_text("".join(json.dumps(r) + "\n" for r in records))
    paths["sft_tokens"] = sum(len(tok(r["prompt"] + r["completion"]).input_ids) + 1 for r in sft[:sizes.sft_batch])
    return paths


# -- checks --------------------------------------------------------------------------------------------------------
def check_bf16_vs_fp32(model: Path, steps: int) -> dict:
    import torch

    from rlhfkit.config.common import StrategyArgs
    from rlhfkit.distributed.strategy import DeepSpeedStrategy
    from rlhfkit.models.loading import load_causal_lm

    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(3, 200, (4, 32), generator=g) for _ in range(steps)]
    losses = {}
    for name, bf16 in (("fp32", False), ("bf16", True)):
        args = StrategyArgs(zero_stage=0 if not bf16 else 2, train_batch_size=4, micro_train_batch_size=4,
                            learning_rate=1e-4, lr_warmup_ratio=0.0)
        strategy = DeepSpeedStrategy(args, bf16=bf16)
        strategy.setup_distributed()
        engine = strategy.prepare_train(load_causal_lm(str(model), dtype=torch.float32), 1e-4, steps)
        losses[name] = []
        for ids in batches:
            ids = ids.to(strategy.device)
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            losses[name].append(float(loss))
        del engine
    worst = max(abs(a - b) / abs(a) for a, b in zip(losses["fp32"], losses["bf16"]))
    return {"passed": worst < 0.05, "max_rel_diff": worst, **losses}


def check_engine_logprobs(model: Path, bf16: bool) -> dict:
    import torch
    from transformers import AutoTokenizer

    from rlhfkit.models.loading import load_causal_lm
    from rlhfkit.rl.experience import experience_from_samples
    from rlhfkit.rl.role_forward import action_log_probs
    from rlhfkit.rollout.hf_engine import HFRolloutEngine

    device = "cuda" if torch.cuda.is_available() else "cpu"
    tok = AutoTokenizer.from_pretrained(model)
    lm = load_causal_lm(str(model), dtype=torch.bfloat16 if bf16 else torch.float32)
    engine = HFRolloutEngine(lm, tok, device=device)
    prompts = [[tok.bos_token_id] + tok(f"What is {i}+{i * 3}?").input_ids for i in range(8)]
    samples = engine.generate(prompts, max_new_tokens=16, temperature=1.0, top_p=1.0, top_k=-1, seed=0)
    exp = experience_from_samples(samples, tok.pad_token_id)
    with torch.no_grad():
        trainer = action_log_probs(engine.model, exp.to(device), 1.0).float().cpu()
    mask = exp.action_mask.bool()
    diff = (trainer - exp.rollout_log_probs)[mask].abs()
    worst, mean = float(diff.max()), float(diff.mean())
    passed = worst < 1e-4 if not bf16 else (worst < 0.1 and mean < 0.02)
    return {"passed": passed, "max_abs_diff": worst, "mean_abs_diff": mean, "tokens": int(mask.sum())}


# -- comparisons ---------------------------------------------------------------------------------------------------
def child(system: str, sizes: Sizes, model: Path, paths: dict, out: Path) -> None:
    """Run the three workloads of one system in this process; print one result line."""
    import dpo
    import grpo
    import sft

    for module in (sft, dpo, grpo):
        module.BF16 = sizes.bf16
    sft.BATCH, dpo.BATCH = sizes.sft_batch, sizes.dpo_batch
    grpo.PROMPTS, grpo.SAMPLES, grpo.NEW_TOKENS, grpo.MICRO = (sizes.grpo_prompts, sizes.grpo_samples,
                                                                sizes.grpo_new_tokens, sizes.grpo_micro)
    steps = sizes.steps + sizes.warmup
    result = {}
    for name, module, extra in (("sft", sft, (sizes.sft_max_len,)), ("dpo", dpo, (sizes.dpo_max_len,)),
                                ("grpo", grpo, ())):
        run = module.child_rlhfkit if system == "rlhfkit" else module.child_trl
        clock = run(model, Path(paths[name]), out / f"{name}_{system}", *extra, steps)
        result[name] = common.step_times(clock.ends, sizes.warmup)
    import resource

    result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(common.MARK + json.dumps(result), flush=True)


def trl_available() -> bool:
    return (common.TRL_DIR / "trl").is_dir()


def run_child(system: str, args: argparse.Namespace, paths: dict) -> dict:
    cmd = [sys.executable, str(Path(__file__)), "--child", system, "--workdir", args.workdir,
           "--paths", json.dumps({k: str(v) for k, v in paths.items()})] + (["--smoke"] if args.smoke else [])
    env = common.child_env(system, args.threads)
    env["PYTHONPATH"] = os.pathsep.join([str(BENCH), env["PYTHONPATH"]])
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800, cwd=common.ROOT)
    lines = [x for x in proc.stdout.splitlines() if x.startswith(common.MARK)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{system} child failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n"
                           f"{proc.stderr[-5000:]}")
    return json.loads(lines[-1][len(common.MARK):])


def report(results: dict, sizes: Sizes, paths: dict, load_start: str, smoke: bool) -> list[str]:
    checks = results["checks"]
    lines = [f"Run {time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC on {common.machine()}; "
             f"{common.versions()}; load at start {load_start}, at end {common.load()}.",
             f"Sizes: {json.dumps(asdict(sizes))}.", "", "| check | passed | numbers |", "| --- | --- | --- |"]
    for name, c in checks.items():
        numbers = {k: v for k, v in c.items() if k != "passed"}
        lines.append(f"| {name} | {'yes' if c['passed'] else '**no**'} | {json.dumps(numbers)} |")
    lines += ["", "| workload | metric | rlhfkit | TRL | ratio rlhfkit/TRL (step time) |",
              "| --- | --- | --- | --- | --- |"]
    per_step = {"sft": paths["sft_tokens"], "dpo": sizes.dpo_batch, "grpo": 1}
    metric = {"sft": "tokens/s", "dpo": "pairs/s", "grpo": "s/step"}
    for workload in ("sft", "dpo", "grpo"):
        cells = []
        medians = {}
        for system in common.SYSTEMS:
            times = [t for run in results.get(system, []) for t in run[workload]]
            if not times:
                cells.append("not run")
                continue
            medians[system] = statistics.median(times)
            value = medians[system] if workload == "grpo" else per_step[workload] / medians[system]
            cells.append(f"{value:.3g}")
        ratio = f"{medians['rlhfkit'] / medians['trl']:.2f}" if len(medians) == 2 else "n/a"
        lines.append(f"| {workload} | {metric[workload]} | {cells[0]} | {cells[1]} | {ratio} |")
    if "trl" not in results:
        lines += ["", "TRL was not run: bench/.trl holds no TRL (install it with `pip install --no-deps --target "
                  "bench/.trl trl==1.16.0`)."]
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU (CI)")
    p.add_argument("--workdir", default=str(common.ROOT / "runs" / "bench_gpu"))
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--no_trl", action="store_true", help="skip the TRL children")
    p.add_argument("--child", choices=common.SYSTEMS, help=argparse.SUPPRESS)
    p.add_argument("--paths", help=argparse.SUPPRESS)
    args = p.parse_args()
    import torch

    sizes = SMOKE if args.smoke or not torch.cuda.is_available() else GPU
    workdir = Path(args.workdir).resolve()
    model = model_dir(workdir, sizes)
    if args.child:
        child(args.child, sizes, model, json.loads(args.paths), workdir / "runs")
        return
    load_start = common.load()
    paths = write_data(workdir, sizes, model)
    results: dict = {"checks": {"bf16_vs_fp32": check_bf16_vs_fp32(model, 3),
                                "engine_logprobs": check_engine_logprobs(model, sizes.bf16)}}
    systems = [s for s in common.SYSTEMS if s == "rlhfkit" or (trl_available() and not args.no_trl)]
    for rep in range(1 if args.smoke else args.repeats):
        for system in (systems if rep % 2 == 0 else systems[::-1]):
            results.setdefault(system, []).append(run_child(system, args, paths))
    lines = report(results, sizes, paths, load_start, args.smoke)
    out = workdir / "gpu_smoke.md" if args.smoke else common.RESULTS_DIR / "gpu.md"
    out.write_text("# GPU suite (bench/gpu/suite.py)" + (" -- smoke run on CPU" if args.smoke else "") + "\n\n"
                   + "\n".join(lines) + "\n")
    (workdir / "gpu_results.json").write_text(json.dumps(results, indent=1))
    print("\n".join(lines))
    print(f"results: {out}")
    if not all(c["passed"] for c in results["checks"].values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
