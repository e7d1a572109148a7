"""Hostile agent files on the tiny HF engine: each costs its own episodes (counted by failure kind), or stops the
run with one line before training; none ends the test process, none hangs it (issue 25, acceptance 3)."""

from __future__ import annotations

import time

import pytest
from transformers import AutoTokenizer

from rlhfkit.agents.episodes import episodes_to_samples, run_episodes
from rlhfkit.errors import UserError
from rlhfkit.rollout.hf_engine import HFRolloutEngine

SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1}
HEADER = "import math, os, sys, time\nfrom rlhfkit.agents import AgentInstanceBase, MultiTurnAgentExecutor\n"
EXECUTOR = """
class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
"""
INSTANCE = """
class AgentInstance(AgentInstanceBase):
    async def step(self, states, **kwargs):
        return {"rewards": 1.0, "done": True}
"""
# step's output per label: the wrong types and a NaN reward
BAD_STEPS = HEADER + """
class AgentInstance(AgentInstanceBase):
    async def step(self, states, **kwargs):
        return {"list": [1.0], "text": {"rewards": "high", "done": True}, "nan": {"rewards": math.nan, "done": True},
                "ok": {"rewards": 1.0, "done": True}}[states["label"]]
""" + EXECUTOR
BLOCKING_EXECUTE = HEADER + INSTANCE + EXECUTOR + """
    async def execute(self, prompt, label, sampling_params):
        if label == "block":
            time.sleep(20)  # blocks the episodes' event loop: asyncio cannot interrupt it
        return await super().execute(prompt, label, sampling_params)
"""
HTTP_AGENT = """
import json, math, os, time, urllib.request
from rlhfkit.agents import OpenAIAgentExecutor


class AgentExecutor(OpenAIAgentExecutor):
    def run_agent(self, base_url, prompt, label):
        if label == "block":
            time.sleep(20)
        if label == "exit":
            os._exit(0)
        body = json.dumps({"messages": [{"role": "user", "content": prompt}], "max_tokens": 3}).encode()
        request = urllib.request.Request(base_url + "/chat/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        urllib.request.urlopen(request, timeout=30).read()
        return {"ok": 1.0, "nan": math.nan, "text": "high"}[label]
"""


@pytest.fixture(scope="module")
def tokenizer(demo_assets):
    return AutoTokenizer.from_pretrained(demo_assets.model_dir)


@pytest.fixture(scope="module")
def engine(demo_assets, tokenizer):
    return HFRolloutEngine.from_pretrained(str(demo_assets.model_dir), tokenizer)


def agent(tmp_path, text: str) -> str:
    path = tmp_path / "agent.py"
    path.write_text(text)
    return str(path)


def requests(tokenizer, labels: list[str]) -> list[dict]:
    text = "User: What is 10+20?\nAssistant: "
    ids = [tokenizer.bos_token_id] + tokenizer.encode(text, add_special_tokens=False)
    return [{"prompt": text, "prompt_ids": ids, "label": label} for label in labels]


def run(engine, tokenizer, path: str, labels: list[str], **kwargs) -> list[dict]:
    options = {"max_steps": 2, "max_length": 12, "seed": 0, "step_timeout": 2.0, "agent_workers": 2, **kwargs}
    return run_episodes(engine.generate, tokenizer, path, requests(tokenizer, labels), **options, **SAMPLING)


def kinds(episodes: list[dict]) -> list[str]:
    return [e["error"].split(":", 1)[0] if e["finish"] == "failed" else "ok" for e in episodes]


@pytest.mark.parametrize("line, timeout, expect", [
    ("os._exit(0)", 10.0, "importing it killed the worker (the worker exited (exit code 0))"),
    ("sys.exit(0)", 10.0, "SystemExit: 0"),
    ("time.sleep(1e9)", 1.0, "importing it took more than 1 s"),
], ids=["os_exit", "sys_exit", "sleep"])
def test_module_level_exit_or_hang_stops_with_one_line_before_this_process_imports(engine, tokenizer, tmp_path,
                                                                                   line, timeout, expect):
    path = agent(tmp_path, HEADER + line + "\n" + INSTANCE + EXECUTOR)
    with pytest.raises(UserError) as info:  # this process survives: the file ran in a worker first
        run(engine, tokenizer, path, ["ok"], step_timeout=timeout)
    text = str(info.value)
    assert "\n" not in text and text.startswith(f"agent {path}: importing it in a worker failed") and expect in text


def test_executor_init_raising_is_one_line(engine, tokenizer, tmp_path):
    path = agent(tmp_path, HEADER + INSTANCE + EXECUTOR + "        raise ValueError('no config here')\n")
    with pytest.raises(UserError, match=r"^agent .*agent.py: AgentExecutor\(\) raised ValueError: no config here$"):
        run(engine, tokenizer, path, ["ok"])


def test_wrong_type_and_nan_step_outputs_cost_their_episodes(engine, tokenizer, tmp_path):
    eps = run(engine, tokenizer, agent(tmp_path, BAD_STEPS), ["ok", "list", "text", "nan"])
    assert kinds(eps) == ["ok", "bad_output", "bad_output", "non_finite"]
    assert eps[1]["error"] == "bad_output: step returned list, not a dict (rewards, environment_feedback, done)"
    samples, reward = episodes_to_samples(eps, fallback=-1.0, max_failure_ratio=1.0)
    assert reward["rewards"].tolist() == [1.0, -1.0, -1.0, -1.0]
    assert (reward["metrics"]["agent/failure_kinds/bad_output"], reward["metrics"]["agent/failure_kinds/non_finite"]) \
        == (2.0, 1.0)
    with pytest.raises(UserError) as info:  # the strict ratio stops the run with one line
        episodes_to_samples(eps, max_failure_ratio=0.0, where="agent X")
    assert "\n" not in str(info.value) and str(info.value).startswith("agent X: bad_output: step returned list")
    assert "3 of 4 episodes failed this step (--max_reward_failure_ratio 0 allows none)" in str(info.value)


def test_a_nan_episode_reward_is_a_counted_failure_with_the_fallback():
    episode = {"prompt_ids": [1], "response_ids": [2], "logprobs": [0.0], "action_mask": [1], "reward": float("nan"),
               "score": 0.0, "turns": 1, "feedback_tokens": 0, "finish": "done", "extra_logs": {}, "error": "",
               "truncated": False}
    _, reward = episodes_to_samples([episode, {**episode, "reward": 0.5, "score": 0.5}], fallback=-2.0)
    assert reward["rewards"].tolist() == [-2.0, 0.5] and reward["scores"].tolist() == [-2.0, 0.5]
    assert reward["metrics"]["agent/failure_kinds/non_finite"] == 1.0


def test_a_blocking_execute_fails_the_unfinished_episodes_after_the_timeout(engine, tokenizer, tmp_path):
    path = agent(tmp_path, BLOCKING_EXECUTE)
    started = time.perf_counter()
    eps = run(engine, tokenizer, path, ["ok", "block"], step_timeout=1.0)
    assert time.perf_counter() - started < 10  # not the 20 s the execute sleeps
    assert kinds(eps) == ["timeout", "timeout"]  # the loop both share was blocked: neither could finish
    assert "blocked the episodes' event loop for more than 1 s" in eps[1]["error"]
    assert kinds(run(engine, tokenizer, path, ["ok"], step_timeout=1.0)) == ["ok"]  # the engine serves on


def test_blocking_exiting_and_bad_run_agent_cost_their_episodes_in_workers(engine, tokenizer, tmp_path):
    started = time.perf_counter()
    eps = run(engine, tokenizer, agent(tmp_path, HTTP_AGENT), ["ok", "block", "exit", "nan", "text"])
    assert time.perf_counter() - started < 15
    assert kinds(eps) == ["ok", "timeout", "crash", "ok", "bad_output"], [e["error"] for e in eps]
    assert eps[0]["reward"] == 1.0 and eps[2]["error"] == "crash: run_agent: the worker exited (exit code 0)"
    _, reward = episodes_to_samples(eps, fallback=0.0)
    assert reward["metrics"]["agent/failures"] == 4.0 and reward["metrics"]["agent/failure_kinds/non_finite"] == 1.0


def test_a_blocking_run_agent_in_a_thread_does_not_hold_the_run(engine, tokenizer, tmp_path):
    started = time.perf_counter()  # no workers: run_agent runs in a daemon thread of this process
    eps = run(engine, tokenizer, agent(tmp_path, HTTP_AGENT), ["ok", "block"], agent_workers=0, step_timeout=1.0)
    assert time.perf_counter() - started < 10
    assert kinds(eps) == ["ok", "timeout"] and eps[1]["error"] == "timeout: run_agent took more than 1 s"
