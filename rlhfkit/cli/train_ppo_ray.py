"""`python -m rlhfkit.cli.train_ppo_ray`: online RL with Ray roles and vLLM (or Transformers) rollout engines.

The flags are OpenRLHF's. Every role (actor, critic, reference, reward model) runs as a Ray actor group with
`--{role}_num_nodes x --{role}_num_gpus_per_node` ranks; `--vllm_num_engines` vLLM engines generate (0: one
Transformers engine). Launch it directly (starts a local Ray) or on a running cluster:
    ray start --head --node-ip-address 127.0.0.1 --num-gpus 8
    ray job submit --address http://127.0.0.1:8265 -- python -m rlhfkit.cli.train_ppo_ray \\
        --pretrain ./sft --reward_pretrain ./rm --prompt_data prompts.jsonl --input_key prompt \\
        --actor_num_gpus_per_node 8 --vllm_num_engines 4 --vllm_tensor_parallel_size 2 --colocate_all_models \\
        --vllm_enable_sleep --deepspeed_enable_sleep --advantage_estimator group_norm --n_samples_per_prompt 8
Every input mistake (batch arithmetic, placement, engines, paths, prompts, reward source) fails before Ray starts,
with one line and exit code 2.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from rlhfkit.cli.common import dry_run, quiet_libraries, run_cli
from rlhfkit.config.base import parse_config
from rlhfkit.config.rl import PPOConfig, validate_rl_config

PROG = "rlhfkit.cli.train_ppo_ray"


def main(argv: Sequence[str] | None = None) -> int:
    quiet_libraries()
    cfg = parse_config(PPOConfig, argv, PROG, __doc__)
    if cfg.plan.dry_run:  # the trainer validates again; a dry run must fail on the same mistakes
        validate_rl_config(cfg)
    if dry_run(cfg, "ppo_ray", PROG):
        return 0
    from rlhfkit.trainers.ray_run import run_ppo_ray

    run_ppo_ray(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main, prog=PROG))
