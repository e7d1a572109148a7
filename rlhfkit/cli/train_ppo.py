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

from rlhfkit.cli.common import cli_main, run_cli
from rlhfkit.config.rl import PPOConfig, validate_single_process

PROG = "rlhfkit.cli.train_ppo"


def validate(cfg: PPOConfig) -> None:
    """A single-process run's own rule (no --async_train) and the inputs (parsing validated the flags)."""
    validate_single_process(cfg)
    cfg.check_inputs()


main = cli_main(PPOConfig, PROG, __doc__, "rlhfkit.rl.local_run:run_ppo", plan_as="ppo", validate=validate,
                validate_always=True)


if __name__ == "__main__":
    sys.exit(run_cli(main, prog=PROG))
