"""`train_ppo_ray` with `--ring_attn_size 2` end to end, against the same run on one rank per role.

Issue 20, acceptance 3 (RL part), end to end. PPO (GAE) on the demo's tiny model, packed samples, fp32, gloo, 2 RL
steps, with a trained critic and a reward model (`demo_reward_model` of tests/conftest.py rebuilt here):
- "ring2": the actor, the critic and the reward model each on one sequence-parallel group of 2 ranks (DeepSpeed
  ZeRO-0 at world 2, one data-parallel rank), `--ring_head_stride 2` as OpenRLHF's commands give it;
- "world1": every role on 1 rank (the plain torch engine).
Both at --adam_eps 1e-6 (see `argv`). The gradient norms (before clipping) show the gradient scale is the one-rank
one, which AdamW's scale invariance would hide from the weights.
Both runs see the same samples: the Transformers rollout engine samples from the seed and the synced weights. The
figures: per-step gaps of the actor's policy loss, the critic's value loss and the reward; the engine's log-probs of
what it sampled against the trainer's (`train/rollout_logprob_diff`, which under ring2 compares one whole-sample
forward with the group's split forward); the largest gap of the final weights.

    nice .venv/bin/python bench/rl_sequence_parallel.py [--backend fsdp2]   (3-5 minutes on the 2-core machine)

`--backend fsdp2` puts the ring2 roles on FSDP2 instead of DeepSpeed (the world1 run stays the plain engine).

Result: bench/results/rl_sequence_parallel.md (written by this script, with machine, versions, date and load).
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import ROOT, load, machine, versions  # noqa: E402

RESULT = ROOT / "bench" / "results" / "rl_sequence_parallel.md"
KEYS = ("train/actor/policy_loss", "train/critic/value_loss", "train/reward", "train/actor/grad_norm",
        "train/critic/grad_norm")


def assets(work: Path):
    import torch
    from transformers import AutoTokenizer

    from rlhfkit.demo.assets import build_demo_assets
    from rlhfkit.models.value_model import load_value_model

    demo = build_demo_assets(work / "assets", seed=0)
    reward = work / "reward_model"
    torch.manual_seed(0)
    load_value_model(str(demo.model_dir), require_head=False).save_pretrained(reward)
    AutoTokenizer.from_pretrained(demo.model_dir).save_pretrained(reward)
    return demo, reward


def argv(demo, reward: Path, out: Path, ranks: int, backend: str = "deepspeed") -> list[str]:
    ring = ["--ring_attn_size", "2", "--ring_head_stride", "2", "--backend", backend] if ranks == 2 else \
        ["--zero_stage", "0"]
    return ["--pretrain", str(demo.model_dir), "--reward_pretrain", str(reward), "--prompt_data", str(demo.rl_train),
            "--input_key", "prompt", "--input_template", "User: {}\nAssistant: ", "--max_samples", "4",
            "--rollout_batch_size", "2", "--n_samples_per_prompt", "1", "--micro_rollout_batch_size", "1",
            "--train_batch_size", "2", "--micro_train_batch_size", "1", "--generate_max_len", "8",
            "--prompt_max_len", "32", "--actor_learning_rate", "5e-3", "--critic_learning_rate", "5e-3",
            "--advantage_estimator", "gae", "--init_kl_coef", "0", "--vllm_num_engines", "0", "--param_dtype",
            "fp32", "--packing_samples", "--colocate_all_models", "--save_path", str(out),
            # AdamW's first step divides each gradient by its own magnitude: at the default eps (1e-8) a gradient
            # entry near 0 turns a last-bit difference of summation order into an lr-sized one (as in
            # tests/distributed/test_sequence_parallel_parity.py's DPO case); 1e-6 keeps the weights comparable
            "--adam_eps", "1e-6", "--critic_adam_eps", "1e-6",
            "--disable_progress_bar", "--actor_num_gpus_per_node", str(ranks), "--critic_num_gpus_per_node",
            str(ranks), "--reward_num_gpus_per_node", str(ranks), *ring]


def main() -> None:
    from safetensors.torch import load_file

    from rlhfkit.config.base import parse_config
    from rlhfkit.config.rl import PPOConfig
    from rlhfkit.rl.ray_run import run_ppo_ray
    from tests.distributed.ray_cluster import ensure_ray

    backend = sys.argv[sys.argv.index("--backend") + 1] if "--backend" in sys.argv else "deepspeed"
    load_start, started = load(), time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        demo, reward = assets(work)
        ensure_ray()
        rows, weights, seconds = {}, {}, {}
        for name, ranks in (("world1", 1), ("ring2", 2)):
            out = work / name
            t = time.time()
            run_ppo_ray(parse_config(PPOConfig, argv(demo, reward, out, ranks, backend), "bench"))
            seconds[name] = time.time() - t
            lines = (out / "metrics.jsonl").read_text().splitlines()
            rows[name] = [r for r in map(json.loads, lines) if "train/actor/policy_loss" in r]
            weights[name] = load_file(str(out / "model.safetensors"))
    a, b = rows["world1"], rows["ring2"]
    gaps = {k: max(abs(x[k] - y[k]) for x, y in zip(a, b)) for k in KEYS}
    w1, w2 = weights["world1"], weights["ring2"]
    weight_gap = max(float((w1[k] - w2[k]).abs().max()) for k in w1)
    lines = [f"## {started}: ring2 on {backend}", "",
             f"Machine: {machine()}; load at start {load_start}, at end {load()}.",
             f"Versions: {versions()}.", "",
             "| figure | value |", "| --- | --- |", f"| RL steps (each run) | {len(a)} and {len(b)} |",
             *[f"| max per-step gap, {k} | {gaps[k]:.2e} |" for k in KEYS],
             f"| engine vs trainer log-probs, ring2 (per step) | "
             f"{', '.join(format(r['train/rollout_logprob_diff'], '.1e') for r in b)} |",
             f"| max final-weight gap (actor) | {weight_gap:.2e} |",
             f"| wall time world1 / ring2 (s, start-up included) | {seconds['world1']:.0f} / "
             f"{seconds['ring2']:.0f} |",
             ""]
    text = "\n".join(lines)
    print(text)
    header = ("# train_ppo_ray with --ring_attn_size 2 against one rank per role\n\n"
              "Written by bench/rl_sequence_parallel.py (see its docstring for the setup).\n")
    previous = RESULT.read_text() if RESULT.exists() else header
    RESULT.write_text(previous.rstrip() + "\n\n" + text + "\n")


if __name__ == "__main__":
    main()
