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

from rlhfkit.cli.common import cli_main, run_cli
from rlhfkit.config.rl import PPOConfig

PROG = "rlhfkit.cli.train_ppo_ray"

main = cli_main(PPOConfig, PROG, __doc__, "rlhfkit.rl.ray_run:run_ppo_ray",
               plan_as="ppo_ray", validate=PPOConfig.check_inputs)  # parsing validates the flags


if __name__ == "__main__":
    sys.exit(run_cli(main, prog=PROG))
