"""`python -m rlhfkit.cli.train_ppo`: online RL (PPO, REINFORCE++, GRPO, Dr. GRPO, RLOO) in one process.

The flags are OpenRLHF's `train_ppo_ray` flags; every role runs in this process and the Transformers engine
generates. Example (GRPO with a rule-based reward):
    python -m rlhfkit.cli.train_ppo --pretrain ./sft --prompt_data prompts.jsonl --input_key prompt \\
        --label_key answer --remote_rm_url examples/reward_func.py --advantage_estimator group_norm \\
        --n_samples_per_prompt 8 --rollout_batch_size 16 --train_batch_size 128 --micro_train_batch_size 16 \\
        --init_kl_coef 0 --actor_learning_rate 1e-4 --save_path ./grpo
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from rlhfkit.cli.common import dry_run, quiet_libraries, run_cli
from rlhfkit.config.base import parse_config
from rlhfkit.config.rl import PPOConfig, validate_rl_config, validate_single_process

PROG = "rlhfkit.cli.train_ppo"


def main(argv: Sequence[str] | None = None) -> int:
    quiet_libraries()
    cfg = validate_rl_config(parse_config(PPOConfig, argv, PROG, __doc__))
    validate_single_process(cfg)
    if dry_run(cfg, "ppo", PROG):
        return 0
    from rlhfkit.trainers.rl_run import run_ppo

    run_ppo(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main, prog=PROG))
