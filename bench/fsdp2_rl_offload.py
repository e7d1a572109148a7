"""`train_ppo_ray` GRPO with the actor on 2 FSDP2 ranks and CPU offload, against DeepSpeed ZeRO-0 at world 1.

Issue 20, acceptance 1 (the RL case "with CPU offload too"), the issue's 5 steps. The flags are those of
tests/distributed/test_ray_fsdp2.py (`argv`: the demo's tiny model, fp32, gloo, the Transformers rollout engine,
reference on as many ranks as the actor), which runs the same comparison for 2 of the 5 steps to keep the suite's
time. Runs:
- "zero0": DeepSpeed ZeRO-0, actor and reference on 1 rank each;
- "offload": `--backend fsdp2 --adam_offload --deepspeed_enable_sleep`, actor and reference on 2 ranks each: the
  actor's shards, gradients and AdamW state held by CPUOffloadPolicy, its weights reaching the engine from those
  shards one `full_tensor()` at a time, the roles' sleep/wake around every call.
The figures: the per-step gaps of the policy loss, the KL loss and the reward; the engine's log-probs of what it
sampled against the trainer's (`train/rollout_logprob_diff`, every step); the largest gap of the final weights; what
the actor's ranks reported after the last weight sync (offload policy, where shards and AdamW moments live).

    nice .venv/bin/python bench/fsdp2_rl_offload.py   (about a minute on the 2-core machine)

Result: bench/results/fsdp2_rl_offload.md (written by this script, with machine, versions, date and load).
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import ROOT, load, machine, versions  # noqa: E402

RESULT = ROOT / "bench" / "results" / "fsdp2_rl_offload.md"
KEYS = ("train/actor/policy_loss", "train/actor/kl_loss", "train/reward")
FLAGS = {"zero0": ["--zero_stage", "0", "--actor_num_gpus_per_node", "1", "--ref_num_gpus_per_node", "1"],
         "offload": ["--backend", "fsdp2", "--adam_offload", "--deepspeed_enable_sleep", "--actor_num_gpus_per_node",
                     "2", "--ref_num_gpus_per_node", "2"]}


def main() -> None:
    from safetensors.torch import load_file

    from rlhfkit.config.base import parse_config
    from rlhfkit.config.rl import PPOConfig
    from rlhfkit.demo.assets import build_demo_assets
    from rlhfkit.rl.ray_run import run_ppo_ray
    from tests.distributed.ray_cluster import ensure_ray
    from tests.distributed.test_ray_fsdp2 import argv, offload_probe, rows

    load_start, started = load(), time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        demo = build_demo_assets(work / "assets", seed=0)
        ensure_ray()
        steps, weights, seconds, probes = {}, {}, {}, []
        for name, flags in FLAGS.items():
            out = work / name
            t = time.time()
            run_ppo_ray(parse_config(PPOConfig, argv(demo, out, *flags), "bench"),
                        after_sync=[lambda trainer: probes.append(trainer.actor.run_on_ranks(offload_probe))])
            seconds[name] = time.time() - t
            steps[name], weights[name] = rows(out), load_file(str(out / "model.safetensors"))
    a, b = steps["zero0"], steps["offload"]
    gaps = {k: max(abs(x[k] - y[k]) for x, y in zip(a, b)) for k in KEYS}
    w1, w2 = weights["zero0"], weights["offload"]
    weight_gap = max(float((w1[k] - w2[k]).abs().max()) for k in w1)
    last = [{k: v for k, v in r.items() if k != "sleep"} | {"reloads": r["sleep"]["reloads"]} for r in probes[-1]]
    lines = [f"## {started}", "",
             f"Machine: {machine()}; load at start {load_start}, at end {load()}.",
             f"Versions: {versions()}.", "",
             "| figure | value |", "| --- | --- |", f"| RL steps (each run) | {len(a)} and {len(b)} |",
             *[f"| max per-step gap, {k} | {gaps[k]:.2e} |" for k in KEYS],
             f"| engine vs trainer log-probs, offload (per step) | "
             f"{', '.join(format(r['train/rollout_logprob_diff'], '.1e') for r in b)} |",
             f"| max final-weight gap | {weight_gap:.2e} |",
             f"| actor ranks after the last sync, offload | {last} |",
             f"| wall time zero0 / offload (s, start-up included) | {seconds['zero0']:.0f} / "
             f"{seconds['offload']:.0f} |",
             ""]
    text = "\n".join(lines)
    print(text)
    header = ("# train_ppo_ray GRPO: FSDP2 with CPU offload at world 2 against DeepSpeed ZeRO-0 at world 1\n\n"
              "Written by bench/fsdp2_rl_offload.py (see its docstring for the setup).\n")
    previous = RESULT.read_text() if RESULT.exists() else header
    RESULT.write_text(previous.rstrip() + "\n\n" + text + "\n")


if __name__ == "__main__":
    main()
