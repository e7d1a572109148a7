"""Agentic RL learns (issue 10, acceptance 3): two agents on the demo's tiny model, before and after RL.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 .venv/bin/python bench/agents_learning.py --task retry --out runs/agents_bench
    PYTHONPATH=$PWD OMP_NUM_THREADS=1 .venv/bin/python bench/agents_learning.py --task calc --out runs/agents_bench

- retry: examples/agent_retry_addition.py (up to 3 attempts, "wrong, try again" after a wrong one) on the demo's
  addition prompts. The SFT model (demo recipe, addition records only, a short run that leaves headroom) is
  trained by `train_ppo --agent_func_path ... --max_steps 3`; the figure is success within 3 attempts.
- calc: examples/agent_calculator.py (`<calc>EXPR</calc>` evaluated safely, result fed back) on 2-digit x 2-digit
  multiplication, which the tiny model cannot do in its head. SFT on synthetic records generated here: a quarter
  of the problems show the tool (`<calc>a*b</calc>`, then, after the result, the answer), the rest answer
  directly; RL then has a better path to reinforce. Figures: tool-call rate and accuracy of the final answer.

Each evaluation runs the agent's episodes on held-out prompts with the Transformers engine at the training
temperature (1.0), several samples per prompt; the results file gives the standard error for the margin.
Results go to <out>/<task>_seed<seed>.json and are printed as a markdown row (bench/results/agents_learning.md).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import random
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TEMPLATE = "User: {}\nAssistant: "
AGENTS = {"retry": REPO / "examples" / "agent_retry_addition.py", "calc": REPO / "examples" / "agent_calculator.py",
          "tools": REPO / "examples" / "agent_tools.py"}
# The tools task's chat template, written for this bench: the Hermes/Qwen tool-call format (<tool_call>{json}
# </tool_call>, results as `tool` messages) in few tokens, so the tiny model's context stays short.
TOOLS_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- if tools -%}{{- 'Tools:' -}}{%- for tool in tools -%}{{- ' ' + tool.function.name -}}{%- endfor -%}"
    "{{- '. Call one as <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>\n' -}}{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message.role == 'user' -%}{{- 'User: ' + message.content + '\n' -}}"
    "{%- elif message.role == 'assistant' -%}{{- 'Assistant: ' + (message.content or '') + eos_token + '\n' -}}"
    "{%- elif message.role == 'tool' -%}{{- 'Tool: ' + message.content + '\n' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- 'Assistant: ' -}}{%- endif -%}")


def module(args: list[str], log: Path) -> None:
    """`python -m ...` in a subprocess (one thread), its output in `log`; a failure stops the bench."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    with open(log, "w") as f:
        proc = subprocess.run([sys.executable, "-m", *args], stdout=f, stderr=subprocess.STDOUT, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"{args[0]} failed (exit {proc.returncode}); see {log}")


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def sft(base: str, data: Path, out: Path, steps: int, seed: int, template: str | None, max_len: int) -> Path:
    """The demo's SFT recipe (batch 32, lr 1e-3, Adam betas 0.9/0.98, constant after warm-up)."""
    n = sum(1 for _ in open(data))
    epochs = -(-steps * 32 // n)
    args = ["rlhfkit.cli.train_sft", "--pretrain", base, "--dataset", str(data), "--input_key", "question",
            "--output_key", "response", "--max_len", str(max_len), "--train_batch_size", "32",
            "--micro_train_batch_size", "32", "--max_epochs", str(epochs), "--max_steps", str(steps),
            "--learning_rate", "1e-3", "--lr_warmup_ratio", "0.05", "--lr_scheduler", "constant_with_warmup",
            "--zero_stage", "0", "--seed", str(seed), "--save_path", str(out), "--logging_steps", "50",
            "--ckpt_path", str(out.parent / f"{out.name}_ckpt"),
            "--adam_betas", "0.9", "0.98", "--disable_progress_bar"]
    # train_sft's default template is OpenRLHF's "User: {}\nAssistant: "; records already rendered take none
    args += ["--input_template", template or ""]
    module(args, out.parent / f"{out.name}.log")
    return out


def rl(sft_dir: Path, prompts: Path, out: Path, agent: Path, steps: int, seed: int, template: str | None,
       max_steps: int, max_len: int) -> Path:
    """GRPO-style RL (group-normalised advantages, 8 prompts x 8 episodes a step) through train_ppo."""
    args = ["rlhfkit.cli.train_ppo", "--pretrain", str(sft_dir), "--prompt_data", str(prompts),
            "--input_key", "prompt", "--label_key", "answer", "--agent_func_path", str(agent),
            "--max_steps", str(max_steps), "--generate_max_len", str(max_len), "--prompt_max_len", "64",
            "--advantage_estimator", "group_norm", "--n_samples_per_prompt", "8", "--rollout_batch_size", "8",
            "--micro_rollout_batch_size", "64", "--train_batch_size", "64", "--micro_train_batch_size", "64",
            "--num_episodes", "50", "--max_rl_steps", str(steps), "--temperature", "1.0",
            "--actor_learning_rate", "1e-4", "--lr_warmup_ratio", "0.03", "--init_kl_coef", "0",
            "--zero_stage", "0", "--seed", str(seed), "--logging_steps", "1", "--save_path", str(out),
            "--ckpt_path", str(out.parent / f"{out.name}_ckpt"),
            "--disable_progress_bar"]
    if template:
        args += ["--input_template", template]
    module(args, out.parent / f"{out.name}.log")
    return out


def evaluate(model_dir: Path, task: str, records: list[dict], samples: int, seed: int, max_steps: int,
             max_len: int) -> dict[str, float]:
    """The agent's episodes on `records` (each `samples` times) at temperature 1.0: mean figures and their s.e."""
    import torch
    from transformers import AutoTokenizer

    from rlhfkit.agents.episodes import run_episodes
    from rlhfkit.rollout.hf_engine import HFRolloutEngine

    torch.manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    engine = HFRolloutEngine.from_pretrained(str(model_dir), tok)
    requests = []
    for r in records:
        text = TEMPLATE.format(r["prompt"]) if task == "retry" else r["prompt"]  # tools: the agent renders it
        ids = [tok.bos_token_id] + tok.encode(text, add_special_tokens=False)
        requests += [{"prompt": text, "prompt_ids": ids, "label": r["answer"]}] * samples
    episodes = run_episodes(engine.generate, tok, str(AGENTS[task]), requests, max_steps=max_steps,
                            max_length=max_len, seed=seed, temperature=1.0, top_p=1.0, top_k=-1)
    if task == "retry":
        columns = {"success_within_3": [float(e["reward"] > 0) for e in episodes],
                   "first_attempt": [e["extra_logs"].get("first_attempt_correct", 0.0) for e in episodes]}
    else:
        columns = {"accuracy": [float(e["reward"] > 0) for e in episodes],
                   "tool_call_rate": [float(e["extra_logs"].get("tool_calls", 0) > 0) for e in episodes]}
    if task == "tools":  # episodes whose every call parsed and ran, among those that tried a call
        columns["valid_tool_call"] = [float(e["extra_logs"]["valid_call_rate"] == 1.0) for e in episodes
                                      if e["extra_logs"].get("tool_calls", 0) + e["extra_logs"].get("tool_errors", 0)]
        columns["valid_tool_call"] = columns["valid_tool_call"] or [0.0]
    columns["turns"] = [float(e["turns"]) for e in episodes]
    out: dict[str, float] = {"episodes": float(len(episodes))}
    for name, values in columns.items():
        mean = sum(values) / len(values)
        var = sum((v - mean) ** 2 for v in values) / max(len(values) - 1, 1)
        out[name], out[f"{name}_se"] = mean, math.sqrt(var / len(values))
    return out


def calc_data(seed: int, n_sft: int, n_rl: int, n_eval: int) -> tuple[list[dict], list[dict], list[dict]]:
    """2-digit x 2-digit products; SFT shows the tool on a quarter of its problems (disjoint splits)."""
    rng = random.Random(seed)
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    rng.shuffle(pairs)
    sft_pairs, rl_pairs = pairs[:n_sft], pairs[n_sft:n_sft + n_rl]
    eval_pairs = pairs[n_sft + n_rl:n_sft + n_rl + n_eval]

    def prompt(a: int, b: int) -> str:
        return TEMPLATE.format(f"What is {a}*{b}?")

    sft_records = []
    for i, (a, b) in enumerate(sft_pairs):
        if i % 4 == 0:
            call = f"<calc>{a}*{b}</calc>"
            sft_records.append({"question": prompt(a, b), "response": call})
            sft_records.append({"question": f"{prompt(a, b)}{call}</s><result>{a * b}</result>\n",
                                "response": str(a * b)})
        else:
            sft_records.append({"question": prompt(a, b), "response": str(a * b)})
    as_prompts = [[{"prompt": prompt(a, b), "answer": str(a * b)} for a, b in split] for split in (rl_pairs,
                                                                                                    eval_pairs)]
    return sft_records, as_prompts[0], as_prompts[1]


def tools_model(base: Path, out: Path) -> Path:
    """A copy of the demo model whose tokenizer carries TOOLS_TEMPLATE."""
    import shutil

    from transformers import AutoTokenizer

    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(base, out)
    tok = AutoTokenizer.from_pretrained(str(out))
    tok.chat_template = TOOLS_TEMPLATE
    tok.save_pretrained(str(out))
    return out


def tools_data(tok: object, seed: int, n_sft: int, n_rl: int, n_eval: int) -> tuple[list[dict], list[dict],
                                                                                       list[dict]]:
    """calc_data's products in native tool calling: the texts are what examples/agent_tools.py's episodes render
    (rlhfkit.agents.tool_agent), so SFT teaches the exact tokens RL samples. Half the SFT problems show the tool (the
    call, then, after its `tool` message, the answer): the JSON call is five times as long as calc's `<calc>a*b</calc>`
    and at a quarter, 300 steps, the SFT model never completed one (measured); the rest answer directly."""
    from rlhfkit.agents.tool_agent import feedback_text, render
    from rlhfkit.agents.tools import as_tools

    spec = importlib.util.spec_from_file_location("agent_tools", AGENTS["tools"])
    assert spec is not None and spec.loader is not None
    agent = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(agent)
    tools, eos, bos = as_tools([agent.calculator]), tok.eos_token, tok.bos_token or ""
    rng = random.Random(seed)
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    rng.shuffle(pairs)

    def prompt(a: int, b: int) -> str:
        text = render(tok, [{"role": "user", "content": f"What is {a}*{b}?"}], tools, generation_prompt=True)
        return text[len(bos):] if bos and text.startswith(bos) else text

    records = []
    for i, (a, b) in enumerate(pairs[:n_sft]):
        if i % 2:
            records.append({"question": prompt(a, b), "response": str(a * b)})
            continue
        call = f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{a}*{b}"}}}}</tool_call>'
        result = [{"role": "tool", "name": "calculator", "content": str(a * b), "tool_call_id": "call00002"}]
        user = [{"role": "user", "content": f"What is {a}*{b}?"}]
        records.append({"question": prompt(a, b), "response": call})
        records.append({"question": prompt(a, b) + call + eos + feedback_text(tok, user, result, tools, eos),
                        "response": str(a * b)})
    splits = (pairs[n_sft:n_sft + n_rl], pairs[n_sft + n_rl:n_sft + n_rl + n_eval])
    rl_records, held_out = ([{"prompt": f"What is {a}*{b}?", "answer": str(a * b)} for a, b in split]
                            for split in splits)
    return records, rl_records, held_out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", choices=sorted(AGENTS), required=True)
    p.add_argument("--out", default="runs/agents_bench")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sft_steps", type=int, default=None, help="default: retry 450, calc 300, tools 800")
    p.add_argument("--rl_steps", type=int, default=None, help="default: retry 60, calc 120")
    p.add_argument("--eval_samples", type=int, default=2, help="episodes per held-out prompt")
    p.add_argument("--reuse_sft", action="store_true", help="keep <out>/<task>_seed<seed>/sft from an earlier run")
    a = p.parse_args()
    from rlhfkit.demo.assets import build_demo_assets

    out = Path(a.out) / f"{a.task}_seed{a.seed}"
    out.mkdir(parents=True, exist_ok=True)
    assets = build_demo_assets(Path(a.out) / "assets", seed=0)
    started = time.time()
    if a.task == "retry":
        sft_steps, rl_steps, max_steps, max_len = a.sft_steps or 450, a.rl_steps or 60, 3, 40
        sft_data = write_jsonl(out / "sft.jsonl", [r for r in assets.read("sft_train") if r["task"] == "addition"])
        rl_data = write_jsonl(out / "rl.jsonl", [r for r in assets.read("rl_train") if r["task"] == "addition"])
        held_out = [r for r in assets.read("rl_eval") if r["task"] == "addition"]
        template = TEMPLATE
    elif a.task == "tools":
        from transformers import AutoTokenizer

        base = tools_model(assets.model_dir, out / "base")
        sft_steps, rl_steps, max_steps, max_len = a.sft_steps or 800, a.rl_steps or 120, 3, 72
        sft_records, rl_records, held_out = tools_data(AutoTokenizer.from_pretrained(str(base)), a.seed, 600,
                                                       2000, 150)
        sft_data, rl_data = write_jsonl(out / "sft.jsonl", sft_records), write_jsonl(out / "rl.jsonl", rl_records)
        template = None
    else:
        sft_steps, rl_steps, max_steps, max_len = a.sft_steps or 300, a.rl_steps or 120, 3, 32
        sft_records, rl_records, held_out = calc_data(a.seed, 600, 2000, 150)
        sft_data, rl_data = write_jsonl(out / "sft.jsonl", sft_records), write_jsonl(out / "rl.jsonl", rl_records)
        template = None
    start_model = str(out / "base") if a.task == "tools" else str(assets.model_dir)
    if a.reuse_sft and (out / "sft" / "model.safetensors").is_file():
        sft_dir = out / "sft"  # a run that stopped after SFT: the same data and seed made it
    else:
        sft_dir = sft(start_model, sft_data, out / "sft", sft_steps, a.seed, template,
                      {"retry": 64, "calc": 96, "tools": 160}[a.task])
    sft_time = time.time() - started
    before = evaluate(sft_dir, a.task, held_out, a.eval_samples, a.seed, max_steps, max_len)
    print("before", json.dumps(before), flush=True)
    started = time.time()
    rl_dir = rl(sft_dir, rl_data, out / "rl", AGENTS[a.task], rl_steps, a.seed, template, max_steps, max_len)
    rl_time = time.time() - started
    after = evaluate(rl_dir, a.task, held_out, a.eval_samples, a.seed, max_steps, max_len)
    print("after", json.dumps(after), flush=True)
    result = {"task": a.task, "seed": a.seed, "sft_steps": sft_steps, "rl_steps": rl_steps,
              "held_out_prompts": len(held_out), "before": before, "after": after, "sft_s": round(sft_time, 1),
              "rl_s": round(rl_time, 1), "load_avg": os.getloadavg()}
    (Path(a.out) / f"{a.task}_seed{a.seed}.json").write_text(json.dumps(result, indent=1))
    keys = [k for k in before if not k.endswith("_se") and k != "episodes"]
    print(f"| {a.task} | {a.seed} | " + " | ".join(
        f"{before[k]:.3f}±{before[k + '_se']:.3f} → {after[k]:.3f}±{after[k + '_se']:.3f}" for k in keys) + " |")


if __name__ == "__main__":
    main()
