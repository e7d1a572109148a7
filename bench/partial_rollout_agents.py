"""Benchmark record: async agents with partial rollout (issue 22, build item 5) on the Transformers and vLLM engines.

For each engine, two train_ppo_ray runs on the demo's tiny model with `--async_train --partial_rollout` and an agent
of short turns (4 tokens, feedback " ok ", 3 turns, written into the output folder):
1. a run of `--steps` steps with `--async_queue_size 2`: per step, the staleness (at most the queue size), the mean
   per-token staleness and the share of samples whose tokens come from more than one policy version (episodes that
   went on across a weight update), plus the per-token versions of the saved samples (samples.jsonl);
2. the same command with the generator SIGKILLed after the first weight update: seconds until the run stops, and
   whether its error names the rollout generator (goal: within 60 s).
Prints the table and appends it with machine, versions, date and load to bench/results/partial_rollout_agents.md.

    OMP_NUM_THREADS=1 .venv/bin/python bench/partial_rollout_agents.py [--steps 6] [--engines transformers|vllm]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python bench/partial_rollout_agents.py`

from bench.async_rl import versions  # noqa: E402 - after the path insert

RESULTS = Path(__file__).with_name("results") / "partial_rollout_agents.md"
AGENT = '''from rlhfkit.agents import AgentExecutorBase, AgentInstanceBase


class AgentInstance(AgentInstanceBase):
    async def step(self, states, **kwargs):
        return {"rewards": float("7" in states["action_text"]), "environment_feedback": " ok ", "done": False}


class AgentExecutor(AgentExecutorBase):
    def __init__(self, max_steps, max_length, llm_engine, hf_tokenizer, result_queue):
        super().__init__(AgentInstance, max_steps, max_length, llm_engine, hf_tokenizer, result_queue)

    async def execute(self, prompt, label, sampling_params, *args, **kwargs):
        return await super().execute(prompt, label, {**sampling_params, "max_tokens": 4}, *args, **kwargs)
'''


def argv_for(assets, out: Path, agent: Path, engine: str, steps: int) -> list[str]:
    return ["--pretrain", str(assets.model_dir), "--prompt_data", str(assets.rl_train), "--input_key", "prompt",
            "--label_key", "answer", "--input_template", "User: {}\nAssistant: ", "--max_samples", str(2 * steps),
            "--rollout_batch_size", "2", "--n_samples_per_prompt", "2", "--micro_rollout_batch_size", "2",
            "--train_batch_size", "4", "--micro_train_batch_size", "1", "--generate_max_len", "24",
            "--prompt_max_len", "32", "--actor_learning_rate", "5e-3", "--zero_stage", "2",
            "--save_path", str(out / "final"), "--ckpt_path", str(out / "ckpt"), "--disable_progress_bar",
            "--actor_num_gpus_per_node", "1", "--ref_num_gpus_per_node", "1", "--advantage_estimator", "reinforce",
            "--init_kl_coef", "0.01", "--vllm_num_engines", "1" if engine == "vllm" else "0",
            "--async_train", "--async_queue_size", "2", "--partial_rollout", "--partial_rollout_chunk_len", "2",
            "--enable_vllm_is_correction", "--agent_func_path", str(agent), "--max_steps", "3"]


def rows_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def train(argv: list[str], out: Path) -> dict:
    from rlhfkit.config.base import parse_config
    from rlhfkit.config.rl import PPOConfig
    from rlhfkit.rl.ray_run import run_ppo_ray

    started = time.perf_counter()
    run_ppo_ray(parse_config(PPOConfig, argv, "bench"))
    seconds = time.perf_counter() - started
    steps = [r for r in rows_of(out / "final" / "metrics.jsonl") if "train/actor/policy_loss" in r]
    samples = rows_of(out / "final" / "samples.jsonl")
    return {"seconds": seconds, "steps": len(steps),
            "staleness": [r["train/async/staleness"] for r in steps],
            "token_staleness": [r["train/async/token_staleness_mean"] for r in steps],
            "mixed": [r["train/async/mixed_version_samples"] for r in steps],
            "example": next((s["policy_versions"] for s in samples if len(set(s["policy_versions"])) > 1),
                            samples[-1]["policy_versions"])}


def kill(argv: list[str]) -> dict:
    from rlhfkit.config.base import parse_config
    from rlhfkit.config.rl import PPOConfig
    from rlhfkit.rl.ray_run import run_ppo_ray

    killed: list[float] = []

    def kill_generator(trainer):
        if trainer.supply.generator is not None and not killed:
            os.kill(trainer.supply.generator_pid, signal.SIGKILL)
            killed.append(time.monotonic())

    try:
        run_ppo_ray(parse_config(PPOConfig, argv, "bench"), after_sync=[kill_generator])
        return {"stopped_s": float("nan"), "message": "the run did not stop"}
    except Exception as e:  # noqa: BLE001 - what a user would see
        return {"stopped_s": time.monotonic() - killed[0] if killed else float("nan"),
                "message": str(e).splitlines()[0][:160]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/bench_partial_rollout_agents")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--engines", nargs="+", default=["transformers", "vllm"])
    p.add_argument("--results", type=Path, default=RESULTS)
    args = p.parse_args()
    for key, value in {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "RAY_USAGE_STATS_ENABLED": "0",
                       "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled"}.items():
        os.environ.setdefault(key, value)
    from rlhfkit.demo.assets import build_demo_assets

    load_before = os.getloadavg()
    out = Path(args.out).resolve()
    shutil.rmtree(out, ignore_errors=True)
    assets = build_demo_assets(out / "assets", seed=0)
    agent = out / "agent_short_turns.py"
    agent.write_text(AGENT)
    header = ["| engine | steps | wall (s) | staleness per step (queue 2) | token staleness mean per step | "
              "mixed-version samples per step | a saved sample's per-token versions | SIGKILL of the generator: "
              "stopped after (s), message |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    rows = []
    for engine in args.engines:  # (one engine per invocation keeps the Ray restarts of a loaded machine few)
        run = train(argv_for(assets, out / engine, agent, engine, args.steps), out / engine)
        dead = kill(argv_for(assets, out / f"{engine}_kill", agent, engine, args.steps))
        fmt = lambda xs: " ".join(f"{x:.2f}" for x in xs)  # noqa: E731
        rows.append(f"| {engine} | {run['steps']} | {run['seconds']:.1f} | {fmt(run['staleness'])} | "
                    f"{fmt(run['token_staleness'])} | {fmt(run['mixed'])} | {run['example']} | "
                    f"{dead['stopped_s']:.1f}, {dead['message']} |")
    load_after = os.getloadavg()
    head = [f"## {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC: --async_train --partial_rollout "
            f"with a 3-turn agent, {args.steps} steps, queue 2, chunks of 2 tokens", "",
            f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}, Python "
            f"{platform.python_version()}; {versions()}. OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}.",
            f"Load average (1/5/15 min) before: {' '.join(f'{x:.2f}' for x in load_before)}; after: "
            f"{' '.join(f'{x:.2f}' for x in load_after)} (the machine is shared).", ""]
    text = "\n".join(head + header + rows + ["", ""])
    print(text)
    with args.results.open("a") as f:
        if f.tell() == 0:
            f.write("# Async agents with partial rollout\n\nScript: `bench/partial_rollout_agents.py`. Each section "
                    "is one run of it.\n\n")
        f.write(text)

if __name__ == "__main__":
    main()
