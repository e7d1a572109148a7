"""examples/agent_calculator.py: the safe evaluator, the tool loop of one instance, and episodes on the real engine."""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from rlhfkit.agents.episodes import run_episodes
from rlhfkit.rollout.hf_engine import HFRolloutEngine

FILE = Path(__file__).resolve().parents[2] / "examples" / "agent_calculator.py"
spec = importlib.util.spec_from_file_location("agent_calculator", FILE)
calc = importlib.util.module_from_spec(spec)
spec.loader.exec_module(calc)


@pytest.mark.parametrize("expr, value", [("12*34", 408), ("(7 + 3) * -2", -20), ("2 ** 10 - 1", 1023),
                                         ("7 / 2", 3.5), ("7 // 2", 3), ("17 % 5", 2), (" 1.5*4 ", 6.0)])
def test_safe_eval_computes(expr, value):
    assert calc.safe_eval(expr) == value


@pytest.mark.parametrize("expr, message", [
    ("__import__('os').system('true')", "Call is not allowed"), ("x + 1", "Name is not allowed"),
    ("(1).real", "Attribute is not allowed"), ("2 ** 100000", "exponent above 64"), ("1 / 0", "division by zero"),
    ("10 ** 40", "result out of range"), ("1 +", "not an expression"), ("'a' * 3", "Constant is not allowed"),
    ("9" * 300, "longer than 200"),
])
def test_bad_expressions_are_refused(expr, message):
    with pytest.raises(ValueError, match=message):
        calc.safe_eval(expr)


def test_a_tool_call_is_answered_then_the_final_answer_is_rewarded():
    agent = calc.AgentInstance()
    state = {"label": "408", "sampling_params": None, "observation_text": "What is 12*34?"}
    tool = asyncio.run(agent.step({**state, "action_text": "let me compute <calc>12*34</calc>"}))
    assert tool["environment_feedback"] == "<result>408</result>\n" and not tool["done"] and tool["rewards"] == 0
    bad = asyncio.run(agent.step({**state, "action_text": "<calc>import os</calc>"}))
    assert bad["environment_feedback"].startswith("<result>error: not an expression")
    final = asyncio.run(agent.step({**state, "action_text": "408"}))
    assert final["done"] and final["rewards"] == 1.0 and final["extra_logs"] == {"tool_calls": 2, "correct": 1.0}
    wrong = asyncio.run(calc.AgentInstance().step({**state, "action_text": "407"}))
    assert wrong["done"] and wrong["rewards"] == 0.0 and wrong["extra_logs"]["tool_calls"] == 0


def test_episodes_run_on_the_engine(demo_assets):
    tokenizer = AutoTokenizer.from_pretrained(demo_assets.model_dir)
    engine = HFRolloutEngine.from_pretrained(str(demo_assets.model_dir), tokenizer)
    text = "User: What is 12*34?\nAssistant: "
    ids = [tokenizer.bos_token_id] + tokenizer.encode(text, add_special_tokens=False)
    request = {"prompt": text, "prompt_ids": ids, "label": "408"}
    [episode] = run_episodes(engine.generate, tokenizer, str(FILE), [request], max_steps=4, max_length=16, seed=0,
                             temperature=1.0, top_p=1.0, top_k=-1)
    assert episode["turns"] >= 1 and episode["finish"] in ("done", "turns", "budget")
    assert episode["reward"] in (0.0, 1.0) and len(episode["response_ids"]) <= 16
