"""The GPU suite: correctness checks of the CUDA paths and SFT / DPO / GRPO side by side with TRL 1.16.0.

Runs with what the GPU machine has (torch, transformers; DeepSpeed, datasets and TRL travel as small wheels, see
bench/gpu/README.md; no Ray, no vLLM, so RL runs in one process with the Transformers rollout engine). Every stage
is a child process with its own time limit, and bench/results/gpu.md is rewritten after each, so a stage that
fails or overruns loses its own figures and no others:

1. `checks` (one child): the device's bf16 matmul peak (8192^3, a few seconds; the denominator of MFU, see
   flops.py), then
   - `bf16_vs_fp32`: a few optimizer steps of the same model on the same batches in fp32 (plain-torch engine) and
     bf16 (DeepSpeed bf16, fp32 master weights) give losses within 5% of each other;
   - `engine_logprobs`: the log-probs the Transformers rollout engine reports for the tokens it sampled match the
     trainer's teacher-forced log-probs of the same tokens (fp32: 1e-4; bf16: 0.1 max, 0.02 mean).
2. comparisons, one child process per system and repeat, interleaved (rlhfkit, TRL, then TRL, rlhfkit): SFT
   (tokens/s over all non-pad tokens, MFU), DPO (pairs/s, MFU), GRPO (step time), each with its peak GPU memory
   (torch.cuda.max_memory_allocated), using the children of bench/sft.py, dpo.py and grpo.py at the sizes below.
   The TRL children run only where TRL is importable from bench/.trl. With `--budget_s` a child starts only if the
   time left fits it (as long as the longest child so far took) and is killed at the deadline.

On a GPU: a random-init Qwen2 shaped like Qwen2.5-0.5B, bf16, SFT 8 x ~950 tokens (max_len 1024), DPO 8 pairs of
~140-token prompts (max_len 512), GRPO 16 prompts x 8 samples x 256 new tokens; results go to bench/results/gpu.md.
`--smoke` runs everything on the CPU at tiny sizes (the demo model, fp32, 2 steps), for CI; its results go to
--workdir. bench/gpu/run.sh is the one command for the GPU machine.

    python bench/gpu/suite.py [--smoke] [--workdir runs/bench_gpu] [--repeats 2] [--budget_s 420]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
from checks import child_checks  # noqa: E402
from report import WORKLOADS, environment, per_step, report  # noqa: E402


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
    steps: int  # SFT and DPO: timed steps after `warmup`
    warmup: int
    grpo_steps: int  # GRPO steps are ~7 s each on an H100 (TRL, 128 x 256 tokens): fewer of them
    grpo_warmup: int

    def steps_of(self, workload: str) -> tuple[int, int]:
        """(timed steps, warm-up steps) of a workload."""
        return (self.grpo_steps, self.grpo_warmup) if workload == "grpo" else (self.steps, self.warmup)


SMOKE = Sizes("tiny", False, 4, 16, 48, 2, 16, 48, 2, 2, 4, 4, 2, 1, 2, 1)
# SFT prompts of 900 tokens keep each row (prompt, question, answer: ~950 tokens) inside max_len 1024, so no row
# loses its completion to truncation
GPU = Sizes("qwen05b", True, 8, 900, 1024, 8, 120, 512, 16, 8, 256, 32, 8, 2, 2, 1)


# -- models and data -----------------------------------------------------------------------------------------------
def model_dir(workdir: Path, sizes: Sizes) -> Path:
    _, models = common.build_models(workdir, big=False)
    if sizes.model == "tiny":
        return models["tiny"]
    path = workdir / "qwen05b"
    if not (path / "complete").is_file():  # written last: a killed build is redone
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
        (path / "complete").write_text("")
    return path


def write_data(workdir: Path, sizes: Sizes, model: Path) -> tuple[dict[str, str], dict[str, list[int]]]:
    """The three data files, and the token length of every SFT row and DPO sequence (clipped to max_len)."""
    from transformers import AutoTokenizer

    assets, _ = common.build_models(workdir, big=False)
    tok = AutoTokenizer.from_pretrained(model)
    data = workdir / "data"
    data.mkdir(parents=True, exist_ok=True)

    def prompt(i: int, tokens: int, question: str) -> str:
        return f"User: {common.long_prompt(tok, tokens, i)} {question}\nAssistant: "

    def rows(workload: str, batch: int) -> int:
        steps, warmup = sizes.steps_of(workload)
        return batch * (steps + warmup + 1)

    sft = [{"prompt": prompt(i, sizes.sft_prompt_tokens, r["question"]), "completion": r["response"]}
           for i, r in enumerate(assets.read("sft_train")[:rows("sft", sizes.sft_batch)])]
    dpo = [{"prompt": prompt(i, sizes.dpo_prompt_tokens, r["prompt"]), "chosen": r["chosen"],
            "rejected": r["rejected"]} for i, r in enumerate(assets.read("pref_train")[:rows("dpo", sizes.dpo_batch)])]
    rl = [{"prompt": f"User: {r['prompt']}\nAssistant: ", "answer": r["answer"]}
          for r in assets.read("rl_train")[:rows("grpo", sizes.grpo_prompts)]]
    paths = {}
    for name, records in (("sft", sft), ("dpo", dpo), ("grpo", rl)):
        paths[name] = str(data / f"gpu_{name}.jsonl")
        Path(paths[name]).write_text("".join(json.dumps(r) + "\n" for r in records))

    def length(text: str, max_len: int) -> int:  # + 1: the EOS both systems append
        return min(len(tok(text).input_ids) + 1, max_len)

    lengths = {"sft": [length(r["prompt"] + r["completion"], sizes.sft_max_len) for r in sft],
               "dpo": [length(r["prompt"] + r[side], sizes.dpo_max_len) for r in dpo
                       for side in ("chosen", "rejected")]}
    return paths, lengths


# -- comparisons ---------------------------------------------------------------------------------------------------
def run_workload(system: str, workload: str, sizes: Sizes, model: Path, data: Path, out: Path) -> dict:
    """One workload of one system in this process: {workload: step times, workload_extra: the child's extra
    figures (GRPO: response length, phases), workload_peak_gib: peak GPU memory (None on CPU)}."""
    import gc

    import dpo
    import grpo
    import sft
    import torch

    for module in (sft, dpo, grpo):
        module.BF16 = sizes.bf16
    sft.BATCH, dpo.BATCH = sizes.sft_batch, sizes.dpo_batch
    grpo.PROMPTS, grpo.SAMPLES, grpo.NEW_TOKENS, grpo.MICRO = (sizes.grpo_prompts, sizes.grpo_samples,
                                                                sizes.grpo_new_tokens, sizes.grpo_micro)
    module = {"sft": sft, "dpo": dpo, "grpo": grpo}[workload]
    extra = {"sft": (sizes.sft_max_len,), "dpo": (sizes.dpo_max_len,), "grpo": ()}[workload]
    steps, warmup = sizes.steps_of(workload)
    cuda = torch.cuda.is_available()
    gc.collect()  # the last workload's models are garbage by now: free them before measuring this one's peak
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    run = module.child_rlhfkit if system == "rlhfkit" else module.child_trl
    clock = run(model, data, out / f"{workload}_{system}", *extra, steps + warmup)
    return {workload: common.step_times(clock.ends, warmup), f"{workload}_extra": clock.extra,
            f"{workload}_peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None}


def child(system: str, sizes: Sizes, model: Path, paths: dict, out: Path) -> None:
    """The three workloads of one system in this process; one result line after each, so a workload that fails
    or is killed loses only its own figures."""
    import traceback

    result: dict = {}
    for workload in WORKLOADS:
        started = time.perf_counter()
        try:
            result.update(run_workload(system, workload, sizes, model, Path(paths[workload]), out))
        except Exception as exc:  # noqa: BLE001 -- recorded and reported; the next workload still runs
            traceback.print_exc()
            result[f"{workload}_error"] = f"{type(exc).__name__}: {exc}"[:400]
        result[f"{workload}_wall_s"] = time.perf_counter() - started
        result["peak_rss_mb"] = common.peak_rss_mb()
        print(common.MARK + json.dumps(result), flush=True)


class Stopped(Exception):
    """SIGTERM reached the driver (bench/gpu/run.sh's overall timeout): kill the child, save, stop."""


STOPPED = [False]


def _stop(signum: int, frame: object) -> None:
    raise Stopped


def trl_available() -> bool:
    return (common.TRL_DIR / "trl").is_dir()


def run_child(stage: str, args: argparse.Namespace, paths: dict, timeout: float, gpu: bool) -> tuple[dict, str]:
    """Run one stage as a child, killed at `timeout` or when this driver gets SIGTERM; its stderr and stdout go to
    <workdir>/logs/<stage>.log. Returns its last result line (possibly partial) and an error ('' if none)."""
    system = stage.split("-")[0]
    cmd = [sys.executable, str(Path(__file__)), "--child", system, "--workdir", args.workdir,
           "--paths", json.dumps(paths)] + (["--smoke"] if args.smoke else [])
    env = common.child_env("trl" if system == "trl" else "rlhfkit", args.threads)
    # keep what the caller put on the path (bench/gpu/run.sh: the wheels in /tmp/site, the import blocker)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(BENCH), env["PYTHONPATH"], os.environ.get("PYTHONPATH")] if p)
    if gpu:  # common.child_env pins DeepSpeed to the CPU for the CPU benches
        env.pop("DS_ACCELERATOR", None)
    log = Path(args.workdir) / "logs" / f"{stage}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as sink:
        # same process group as this one: an outer `timeout` (bench/gpu/run.sh) kills the child with it
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=sink, text=True, cwd=common.ROOT)
        try:
            stdout, error = proc.communicate(timeout=max(timeout, 1) if timeout < 1e9 else None)[0], ""
        except (subprocess.TimeoutExpired, Stopped) as exc:
            proc.kill()
            stdout = proc.communicate()[0]
            STOPPED[0] = isinstance(exc, Stopped)
            error = ("stopped by SIGTERM (the overall budget)" if STOPPED[0]
                     else f"killed at its limit ({timeout:.0f} s)")
        sink.write("\n--- stdout ---\n" + stdout)
    if not error and proc.returncode != 0:
        error = f"exit {proc.returncode} (see logs/{stage}.log)"
    lines = [x for x in stdout.splitlines() if x.startswith(common.MARK)]
    return (json.loads(lines[-1][len(common.MARK):]) if lines else {}), error


# -- driver --------------------------------------------------------------------------------------------------------
def plan(args: argparse.Namespace) -> list[str]:
    """The stages in order: the checks, then each repeat's children, interleaved."""
    systems = [s for s in common.SYSTEMS if s == "rlhfkit" or (trl_available() and not args.no_trl)]
    stages = ["checks"]
    for rep in range(1 if args.smoke else args.repeats):
        stages += [f"{s}-{rep + 1}" for s in (systems if rep % 2 == 0 else systems[::-1])]
    return stages


def run_stages(args: argparse.Namespace, paths: dict, gpu: bool, save) -> dict:
    """Run every stage that the budget fits (a child starts only if the time left is at least the longest child so
    far; each is killed at the deadline), saving the report after each."""
    deadline = time.monotonic() + args.budget_s if args.budget_s else float("inf")
    results: dict = {"checks": {}, "notes": [], "stages": {}}
    longest = 0.0
    stages = plan(args)
    try:
        for stage in stages:
            left = deadline - time.monotonic() - 10  # 10 s to write the report
            if stage != "checks" and left < longest:
                results["notes"].append(f"{stage} not run: {left:.0f} s of the budget left, the longest child took "
                                        f"{longest:.0f} s")
                continue
            started = time.monotonic()
            result, error = run_child(stage, args, paths, min(left, 180.0) if stage == "checks" else left, gpu)
            results["stages"][stage] = time.monotonic() - started
            if stage == "checks":
                results["peak"] = result.pop("peak", {})
                results["checks"] = result
            else:
                longest = max(longest, results["stages"][stage])
                results.setdefault(stage.split("-")[0], []).append(result)
            if error:
                results["notes"].append(f"{stage}: {error}")
            save(results)
            if STOPPED[0]:
                break
    except Stopped:  # SIGTERM between two children: keep what is done
        results["notes"].append("stopped by SIGTERM (the overall budget) between stages")
    never = [s for s in stages if s not in results["stages"] and not any(n.startswith(f"{s} ") for n in
                                                                         results["notes"])]
    if never:
        results["notes"].append(f"not run (stopped): {', '.join(never)}")
    save(results)
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU (CI)")
    p.add_argument("--workdir", default=str(common.ROOT / "runs" / "bench_gpu"))
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--budget_s", type=float, default=0, help="stop starting children after this many seconds (0: none)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--no_trl", action="store_true", help="skip the TRL children")
    p.add_argument("--child", choices=(*common.SYSTEMS, "checks"), help=argparse.SUPPRESS)
    p.add_argument("--paths", help=argparse.SUPPRESS)
    args = p.parse_args()
    started = time.monotonic()
    import torch

    gpu = torch.cuda.is_available() and not args.smoke
    sizes = GPU if gpu else SMOKE
    workdir = Path(args.workdir).resolve()
    args.workdir = str(workdir)
    model = model_dir(workdir, sizes)
    if args.child == "checks":
        return child_checks(sizes, model)
    if args.child:
        return child(args.child, sizes, model, json.loads(args.paths), workdir / "runs")
    paths, lengths = write_data(workdir, sizes, model)
    if args.budget_s:
        args.budget_s -= time.monotonic() - started  # the model build and the data came out of it
    work = per_step(sizes, lengths, model)
    header = (f"Run {time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC on {common.machine()}: {environment()}; "
              f"load at start {common.load()}; model and data built in {time.monotonic() - started:.0f} s.")
    out = workdir / "gpu_smoke.md" if args.smoke or not gpu else common.RESULTS_DIR / "gpu.md"

    def save(results: dict) -> None:
        lines = report(results, sizes, work, header)
        out.write_text("# GPU suite (bench/gpu/suite.py)" + (" -- smoke run on CPU" if not gpu else "") + "\n\n"
                       + "\n".join(lines) + "\n")
        (workdir / "gpu_results.json").write_text(json.dumps(results, indent=1))

    signal.signal(signal.SIGTERM, _stop)
    results = run_stages(args, paths, gpu, save)
    print("\n".join(report(results, sizes, work, header)))
    print(f"results: {out}")
    failed = [n for n, c in results["checks"].items() if not c["passed"]] + results["notes"]
    if len(results["checks"]) < 2 or failed or any(f"{w}_error" in run for s in common.SYSTEMS
                                                   for run in results.get(s, []) for w in WORKLOADS):
        sys.exit(1)




if __name__ == "__main__":
    main()
