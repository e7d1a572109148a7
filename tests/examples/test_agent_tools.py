"""examples/agent_tools.py: the calculator tool itself, and two RL steps of the tool agent on the tiny demo model
whose tokenizer carries the Hermes-format test template (tests/agents/tool_templates/hermes.jinja)."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

from rlhfkit.errors import UserError
from tests.helpers import run_here

ROOT = Path(__file__).resolve().parents[2]
FILE = ROOT / "examples" / "agent_tools.py"
TEMPLATE = ROOT / "tests" / "agents" / "tool_templates" / "hermes.jinja"
spec = importlib.util.spec_from_file_location("agent_tools", FILE)
tools = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tools)


def test_the_calculator_tool_and_its_schema():
    assert tools.calculator("12*34") == "408" and tools.calculator("7/2") == "3.5"
    with pytest.raises(ValueError, match="Name is not allowed"):
        tools.calculator("x+1")
    from rlhfkit.agents.tools import as_tools

    [tool] = as_tools(tools.AgentInstance.tools)
    assert tool.parameters["required"] == ["expression"]


def test_tool_format_needs_an_agent():
    from rlhfkit.config.rl import PPOConfig

    cfg = PPOConfig()
    cfg.agent.tool_format = "hermes"
    with pytest.raises(UserError, match="--tool_format hermes is read by a tool agent and needs --agent_func_path"):
        cfg.validate()


def test_two_rl_steps_train_the_tool_agent(demo_assets, tmp_path, capsys):
    from transformers import AutoTokenizer

    model = tmp_path / "model"
    shutil.copytree(demo_assets.model_dir, model)
    tok = AutoTokenizer.from_pretrained(model)
    tok.chat_template = TEMPLATE.read_text()
    tok.save_pretrained(model)
    save = tmp_path / "out"
    proc = run_here([
        "rlhfkit.cli.train_ppo", "--pretrain", str(model), "--prompt_data", str(demo_assets.rl_train),
        "--input_key", "prompt", "--label_key", "answer", "--agent_func_path", str(FILE), "--max_steps", "3",
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
    assert (save / "model.safetensors").is_file()
    from tests.logging.test_html_report import chromium
    from tests.logging.test_trace_view import check_viewer

    saved = [json.loads(x) for x in (save / "samples.jsonl").read_text().splitlines()]
    assert {r["step"] for r in saved} == {1, 2} and all(r["trace"]["turns"] for r in saved)
    if chromium():  # the report's trace viewer shows the saved episodes (tests/logging/test_trace_view.py)
        check_viewer(save / "report.html", saved, tmp_path)
