"""The RL run doctor in a real run (train_ppo, tiny demo model, GRPO with a reference): a healthy 2-step run raises
no alarm; the same run at 100x the learning rate raises the KL or entropy alarm within its first steps (measured:
KL blow-up at step 3 of 20, tests/logging/fixtures/doctor_broken_lr100x.jsonl), on the console and in metrics.jsonl.
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.helpers import run_here
from tests.rl.test_rl_estimators import VARIED_REWARD, check, ppo_args


def doctor_records(save: Path) -> list[dict]:
    rows = [json.loads(x) for x in (save / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if any(k.startswith("doctor/") for k in r)]


def test_broken_run_raises_kl_or_entropy_alarm_and_healthy_run_none(demo_assets, tmp_path, capsys):
    reward = tmp_path / "varied_reward.py"
    reward.write_text(VARIED_REWARD)
    common = ["--remote_rm_url", str(reward), "--zero_stage", "0"]
    healthy = run_here(ppo_args(demo_assets, tmp_path / "healthy", "group_norm", *common, "--max_rl_steps", "2"),
                       capsys)
    check(healthy)
    assert doctor_records(tmp_path / "healthy") == [] and "doctor:" not in healthy.stdout + healthy.stderr
    assert json.loads((tmp_path / "healthy" / "metrics.jsonl").read_text().splitlines()[0])[
        "train/reward_groups_all_equal"] < 0.8

    broken = run_here(ppo_args(demo_assets, tmp_path / "broken", "group_norm", *common, "--max_rl_steps", "6",
                               "--max_samples", "24", "--actor_learning_rate", "1e-1"), capsys)  # 100x ppo_args' 1e-3
    check(broken)
    records = doctor_records(tmp_path / "broken")
    names = {k.removeprefix("doctor/") for r in records for k in r if k.startswith("doctor/")}
    assert names & {"kl_blowup", "entropy_collapse"}, records
    assert all(r["step"] <= 6 for r in records)
    output = broken.stdout + broken.stderr
    assert any(line.startswith("doctor: step ") and "Advice: " in line for line in output.splitlines()), output
