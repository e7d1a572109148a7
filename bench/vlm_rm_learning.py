"""Reward-model learning on an image preference task (issue 21, acceptance 3: RM pairwise accuracy >= 0.7): train_rm
with `--image_key` on the tiny random-init Qwen2-VL (rlhfkit/demo/vlm_assets.py), chosen = the right answer to the
image question, rejected = a wrong one; held-out pairwise accuracy (`eval/acc` of train_rm, chosen scored above
rejected on pairs it never trained on) per seed.

    nice .venv/bin/python bench/vlm_rm_learning.py [--seeds 0 1 2] [--steps 60] [--tasks colour]

Appends a section to bench/results/vlm_learning.md (next to the SFT / GRPO / DPO figures of bench/vlm_learning.py,
whose CLI runner it reuses). `--tasks` keeps the preference records of those synthetic tasks (colour, digit, dots;
default all).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vlm_learning import COMMON, ROOT, cli, last_eval  # noqa: E402  (the sibling bench script)


def task_split(assets, split: str, tasks: list[str] | None) -> Path:
    """The records of `split` whose task is in `tasks`, written next to it (the image paths stay valid)."""
    if not tasks:
        return assets.split(split)
    out = assets.data_dir / f"{split}_{'_'.join(tasks)}.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in assets.read(split) if r["task"] in tasks))
    return out


def one_seed(seed: int, work: Path, args: argparse.Namespace) -> dict:
    from rlhfkit.demo.vlm_assets import build_vlm_assets

    assets = build_vlm_assets(work / f"assets_{seed}", seed=seed, n_sft=16, n_eval=args.n_eval, n_pref=args.n_pref,
                              n_rl=16)
    train, held_out = task_split(assets, "pref_train", args.tasks), task_split(assets, "pref_eval", args.tasks)
    out = work / f"rm_{seed}"
    t = time.time()
    cli("train_rm", "--pretrain", str(assets.model_dir), "--dataset", str(train), "--eval_dataset", str(held_out),
        "--eval_split", "train", "--prompt_key", "prompt", "--train_batch_size", "32", "--micro_train_batch_size",
        "16", "--learning_rate", str(args.lr), "--lr_scheduler", "constant", "--max_epochs", "20", "--max_steps",
        str(args.steps), "--eval_steps", str(args.steps), "--seed", str(seed), "--save_path", str(out),
        "--ckpt_path", str(work / f"ckpt_rm_{seed}"), *COMMON)
    pairs = sum(1 for _ in held_out.open())
    return {"seed": seed, "rm_eval_acc": last_eval(out, "eval/acc"), "held_out_pairs": pairs,
            "rm_s": time.time() - t}


def write(results: list[dict], args: argparse.Namespace, load_start: str) -> Path:
    import importlib.metadata as md

    accs = [r["rm_eval_acc"] for r in results]
    lines = ["", f"## `python bench/vlm_rm_learning.py {' '.join(sys.argv[1:])}`", "",
             f"Machine {platform.machine()}, {os.cpu_count()} CPUs; torch {md.version('torch')}, transformers "
             f"{md.version('transformers')}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; load average "
             f"{load_start} at the start, {' '.join(f'{x:.2f}' for x in os.getloadavg())} at the end.", "",
             f"train_rm --image_key from the untrained tiny Qwen2-VL (vision tower trained too): {args.steps} steps "
             f"of 32 pairs, lr {args.lr} constant, tasks {', '.join(args.tasks or ['all'])}; chosen = the right "
             "answer, rejected = a wrong one. Held-out pairwise accuracy: `eval/acc` of train_rm on the eval pairs.",
             "", "| seed | held-out pairs | RM held-out pairwise acc | RM s |", "| --- | --- | --- | --- |"]
    lines += [f"| {r['seed']} | {r['held_out_pairs']} | {r['rm_eval_acc']:.3f} | {r['rm_s']:.0f} |" for r in results]
    lines += ["", f"Mean over {len(accs)} seeds: {sum(accs) / len(accs):.3f} (lowest {min(accs):.3f})."]
    out = ROOT / "bench" / "results" / "vlm_learning.md"
    with out.open("a", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--tasks", nargs="*", default=None, help="keep these tasks' pairs (colour, digit, dots)")
    p.add_argument("--n_pref", type=int, default=2000, help="preference pairs built (all tasks)")
    p.add_argument("--n_eval", type=int, default=300, help="held-out pairs built (all tasks)")
    p.add_argument("--no_write", action="store_true", help="print the figures, leave the results file alone")
    p.add_argument("--workdir", default="/tmp/rlhfkit_vlm_rm_bench")
    args = p.parse_args()
    load_start = " ".join(f"{x:.2f}" for x in os.getloadavg())
    results = []
    for seed in args.seeds:
        results.append(one_seed(seed, Path(args.workdir), args))
        print(json.dumps(results[-1]), flush=True)
    if not args.no_write:
        print(write(results, args, load_start))


if __name__ == "__main__":
    main()
