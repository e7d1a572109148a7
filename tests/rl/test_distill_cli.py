"""On-policy distillation through train_ppo: 2 steps with a local teacher on agent episodes (feedback tokens masked
out of the distillation loss as out of the policy loss), added to GRPO's policy loss."""

from __future__ import annotations

import json
import math
from pathlib import Path

from tests.helpers import REPO, run_here
from tests.rl.test_distill import teacher_dir  # noqa: F401 (a fixture)

AGENT = REPO / "examples" / "agent_func_math.py"


def test_train_ppo_distills_agent_episodes_from_a_local_teacher(demo_assets, teacher_dir, tmp_path,  # noqa: F811
                                                                capsys):
    save = tmp_path / "out"
    proc = run_here([
        "rlhfkit.cli.train_ppo", "--pretrain", str(demo_assets.model_dir), "--prompt_data", str(demo_assets.rl_train),
        "--input_key", "prompt", "--label_key", "answer", "--input_template", "User: {}\nAssistant: ",
        "--agent_func_path", str(AGENT), "--max_steps", "2", "--advantage_estimator", "group_norm",
        "--n_samples_per_prompt", "2", "--rollout_batch_size", "2", "--micro_rollout_batch_size", "4",
        "--train_batch_size", "4", "--micro_train_batch_size", "2", "--max_samples", "4", "--generate_max_len", "16",
        "--prompt_max_len", "32", "--actor_learning_rate", "1e-3", "--lr_warmup_ratio", "0", "--zero_stage", "0",
        "--teacher_pretrain", str(teacher_dir), "--distill_coef", "0.5", "--save_path", str(save),
        "--disable_progress_bar"], capsys)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "teacher" in proc.stdout
    rows = [json.loads(x) for x in (Path(save) / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "train/actor/distill_loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for row in steps:
        assert math.isfinite(row["train/actor/distill_loss"]) and row["train/actor/distill_loss"] > 0
        assert math.isfinite(row["train/actor/distill_reverse_kl"]) and "train/actor/policy_loss" in row
