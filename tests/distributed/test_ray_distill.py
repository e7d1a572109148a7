"""On-policy distillation through train_ppo_ray: 2 steps with the teacher as its own Ray role group, colocated with
the actor like the reference (--colocate_all_models), distilling alone with the top-k forward KL."""

from __future__ import annotations

import json
import math

import pytest

from rlhfkit.config.base import parse_config
from rlhfkit.config.rl import PPOConfig
from rlhfkit.rl.ray_run import run_ppo_ray
from tests.distributed.test_ray_ppo import REWARD, ppo_argv
from tests.rl.test_distill import teacher_dir  # noqa: F401 (a fixture)


@pytest.mark.limit(300)
def test_ray_run_distills_from_a_teacher_role(ray_cluster, demo_assets, teacher_dir, tmp_path):  # noqa: F811
    argv = ppo_argv(demo_assets, tmp_path, "--advantage_estimator", "group_norm", "--remote_rm_url", REWARD,
                    "--vllm_num_engines", "0", "--colocate_all_models", "--teacher_pretrain", str(teacher_dir),
                    "--distill_only", "--distill_loss", "topk_forward_kl", "--distill_topk", "4")
    trainer = run_ppo_ray(parse_config(PPOConfig, argv, "test"))
    assert type(trainer.teacher).__name__ == "RayActorGroup"
    rows = [json.loads(x) for x in (tmp_path / "final" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "train/actor/distill_loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for row in steps:
        assert math.isfinite(row["train/actor/distill_loss"]) and row["train/actor/distill_loss"] > 0
        assert 0 < row["train/actor/distill_teacher_topk_mass"] <= 1 + 1e-6
