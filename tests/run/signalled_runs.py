"""What the SIGKILL (test_kill_safety.py) and SIGTERM (test_preemption.py) tests share: a trainer CLI started as a
real subprocess, the final weights compared, and the small RL run with a rule-based reward both interrupt."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from safetensors.torch import load_file

from tests.helpers import REPO

TEMPLATE = "User: {}\nAssistant: "
LENGTH_REWARD = ("import torch\n\ndef reward_func(queries, prompts, labels):\n"
                 "    return torch.tensor([len(set(q[len(p):])) / 10 for q, p in zip(queries, prompts)])\n")


def start(args: list[str], *, pause: str | None = None, merge_stderr: bool = False) -> subprocess.Popen:
    """`python -m <args>` with one thread; `pause` sets the checkpoint test hook (`RLHFKIT_TEST_PAUSE`, see
    `rlhfkit.run.pause_points`); with `merge_stderr` stderr goes into stdout."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("RLHFKIT_TEST_PAUSE", None)
    if pause:
        env["RLHFKIT_TEST_PAUSE"] = pause
    return subprocess.Popen([sys.executable, "-m", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE, text=True, env=env,
                            cwd=REPO)


def max_weight_diff(a: Path, b: Path) -> float:
    """Largest absolute difference between two saved models' weights (same tensor names required)."""
    wa, wb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert wa.keys() == wb.keys()
    return max((wa[k].float() - wb[k].float()).abs().max().item() for k in wa)


def rl_args(assets, tmp_path: Path, save: Path, *extra: str, rollout_batch_size: int, train_batch_size: int,
            micro_train_batch_size: int, max_samples: int, generate_max_len: int) -> list[str]:
    """A GRPO train_ppo run on the demo prompts, rewarded for distinct response characters (a reward function
    written into `tmp_path`), ZeRO-0, two samples per prompt."""
    reward = tmp_path / "reward.py"
    reward.write_text(LENGTH_REWARD)
    return ["rlhfkit.cli.train_ppo", "--pretrain", str(assets.model_dir), "--prompt_data", str(assets.rl_train),
            "--input_key", "prompt", "--label_key", "answer", "--input_template", TEMPLATE, "--remote_rm_url",
            str(reward), "--advantage_estimator", "group_norm", "--n_samples_per_prompt", "2",
            "--rollout_batch_size", str(rollout_batch_size), "--micro_rollout_batch_size", "4",
            "--train_batch_size", str(train_batch_size), "--micro_train_batch_size", str(micro_train_batch_size),
            "--max_samples", str(max_samples), "--generate_max_len", str(generate_max_len), "--prompt_max_len",
            "32", "--actor_learning_rate", "1e-3", "--zero_stage", "0", "--save_path", str(save),
            "--disable_progress_bar", *extra]
