"""examples/env_multi_tool.py (calculator and sandboxed Python tools) and examples/env_guess_number.py (a stateful
text game): their logic on scripted actions, and two RL steps of the multi-tool environment on the tiny demo model
whose tokenizer carries the Hermes-format test template (tests/agents/tool_templates/hermes.jinja)."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

from rlhfkit.agents import Action
from rlhfkit.agents.tool_parsers import ToolCall
from tests.helpers import run_here

ROOT = Path(__file__).resolve().parents[2]
MULTI_TOOL = ROOT / "examples" / "env_multi_tool.py"
GUESS = ROOT / "examples" / "env_guess_number.py"
TEMPLATE = ROOT / "tests" / "agents" / "tool_templates" / "hermes.jinja"


def load(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


multi_tool, guess = load(MULTI_TOOL), load(GUESS)


def test_the_python_tool_runs_code_in_the_sandbox():
    assert multi_tool.python("print(sum(range(10)))") == "45\n"
    assert multi_tool.python("1/0") == "error: ZeroDivisionError: division by zero"
    assert multi_tool.python("import socket; socket.socket()").startswith("error: ")  # no network in there
    assert multi_tool.calculator("12*34") == "408"


def test_the_multi_tool_environment_answers_calls_then_rewards_the_answer():
    env = multi_tool.MultiToolEnvironment()
    assert env.reset("What is 12*34+1?", 409) == "What is 12*34+1?"
    calls = [ToolCall("calculator", {"expression": "12*34"}), ToolCall("python", {"code": "print(408+1)"}),
             ToolCall("calculator", {"expression": "x"})]
    step = env.step(Action(text="...", tool_calls=calls, call_errors=["tool call cut off"]))
    assert (step.reward, step.done) == (0.0, False)
    assert [m["content"] for m in step.observation] == [
        "error: tool call cut off", "408", "409\n",
        "error: tool calculator raised ValueError: Name is not allowed (numbers and + - * / // % ** only)"]
    final = env.step(Action(text="It is 409.", content="It is 409."))
    assert (final.reward, final.done, final.info["calls_before_answer"]) == (1.0, True, 3.0)
    assert env.step(Action(text="410", content="410")).reward == 0.0


def test_the_guessing_game_keeps_its_state_across_turns():
    env = guess.GuessTheNumber()
    env.reset("Guess.", "30")
    assert env.step(Action(text="50")).observation == "\nLower.\n"
    assert env.step(Action(text="no idea")).observation == "\nAnswer with a number.\n"
    assert env.step(Action(text="I say 20")).observation == "\nHigher.\n"
    found = env.step(Action(text="30"))
    assert found.done and found.reward == pytest.approx(0.7) and found.info == {"guesses": 4.0, "found": 1.0}
    env.reset("Guess.", "7")
    steps = [env.step(Action(text="1")) for _ in range(guess.MAX_GUESSES)]
    assert [s.done for s in steps] == [False] * (guess.MAX_GUESSES - 1) + [True] and steps[-1].reward == 0.0


def test_the_multi_tool_example_runs_episodes_with_both_tools_in_the_worker_pool(demo_assets):
    from transformers import AutoTokenizer

    from rlhfkit.agents.episodes import run_episodes
    from rlhfkit.rollout.engine import FINISH_STOP, SampledSequence

    tok = AutoTokenizer.from_pretrained(demo_assets.model_dir)
    tok.chat_template = TEMPLATE.read_text()
    calls = [{"name": "calculator", "arguments": {"expression": "12*34"}},
             {"name": "python", "arguments": {"code": "print(408 + 1)"}}]
    turns = ["\n".join(f"<tool_call>\n{json.dumps(c)}\n</tool_call>" for c in calls), "It is 409."]
    sampled = []

    def engine(prompt_ids, *, max_new_tokens, seed=None, **sampling):
        ids = tok.encode(turns.pop(0), add_special_tokens=False) + [tok.eos_token_id]
        sampled.append(ids)
        return [SampledSequence(list(prompt_ids[0]), ids, [-0.5] * len(ids), FINISH_STOP)]

    prompt = "What is 12*34+1?"
    request = {"prompt": prompt, "prompt_ids": [tok.bos_token_id] + tok.encode(prompt), "label": "409"}
    [ep] = run_episodes(engine, tok, str(MULTI_TOOL), [request], max_steps=4, max_length=400, seed=0,
                        step_timeout=30, agent_workers=1, temperature=1.0, top_p=1.0, top_k=-1)
    assert ep["finish"] == "done" and ep["reward"] == 1.0, ep["error"]
    assert ep["extra_logs"]["tool_calls"] == 2.0 and ep["extra_logs"]["calls_before_answer"] == 2.0
    actions = [t for t, m in zip(ep["response_ids"], ep["action_mask"]) if m == 1]
    assert actions == sampled[0] + sampled[1]  # the trained tokens are exactly the sampled ones
    feedback = tok.decode([t for t, m in zip(ep["response_ids"], ep["action_mask"]) if m == 0])
    assert "408" in feedback and "409" in feedback  # both tools' results, as tool messages


def test_two_rl_steps_train_the_multi_tool_environment(demo_assets, tmp_path, capsys):
    from transformers import AutoTokenizer

    model = tmp_path / "model"
    shutil.copytree(demo_assets.model_dir, model)
    tok = AutoTokenizer.from_pretrained(model)
    tok.chat_template = TEMPLATE.read_text()
    tok.save_pretrained(model)
    save = tmp_path / "out"
    proc = run_here([
        "rlhfkit.cli.train_ppo", "--pretrain", str(model), "--prompt_data", str(demo_assets.rl_train),
        "--input_key", "prompt", "--label_key", "answer", "--agent_func_path", str(MULTI_TOOL), "--max_steps", "3",
        "--advantage_estimator", "reinforce", "--n_samples_per_prompt", "2", "--rollout_batch_size", "2",
        "--micro_rollout_batch_size", "4", "--train_batch_size", "4", "--micro_train_batch_size", "2",
        "--max_samples", "4", "--generate_max_len", "48", "--prompt_max_len", "512", "--max_rl_steps", "2",
        "--actor_learning_rate", "1e-3", "--init_kl_coef", "0.01", "--zero_stage", "0", "--save_path", str(save),
        "--disable_progress_bar"], capsys)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(x) for x in (save / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "train/actor/policy_loss" in r]
    assert len(steps) == 2 and all(s["train/agent/failures"] == 0 for s in steps)
    assert all(s["train/rollout_logprob_diff"] < 1e-4 for s in steps)
    assert all("train/reward_extra/tool_calls" in s for s in steps)  # the environment's tool counts are logged
    assert (save / "model.safetensors").is_file()
