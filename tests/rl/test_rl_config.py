"""RL config: OpenRLHF's flags (OpenRLHF's commands parse), derived defaults, and one-line errors with exit code 2."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from rlhfkit.cli.common import run_cli
from rlhfkit.cli.train_ppo import main
from rlhfkit.config.base import parse_config
from rlhfkit.config.rl import (
    PPOConfig,
    clip_range,
    critic_path,
    loss_aggregation,
    needs_reference,
)
from tests.helpers import without_startup_notes

SEED_GRPO = """
--advantage_estimator group_norm --ref_num_nodes 1 --ref_num_gpus_per_node 8 --reward_num_nodes 1
--reward_num_gpus_per_node 8 --actor_num_nodes 1 --actor_num_gpus_per_node 8 --vllm_num_engines 4
--vllm_tensor_parallel_size 2 --colocate_all_models --pretrain OpenRLHF/Llama-3-8b-sft-mixture
--reward_pretrain OpenRLHF/Llama-3-8b-rm-700k --save_path ./output/llama3-8b-grpo --micro_train_batch_size 8
--train_batch_size 128 --micro_rollout_batch_size 16 --rollout_batch_size 1024 --max_epochs 1 --bf16
--actor_learning_rate 5e-7 --init_kl_coef 0.01 --use_kl_loss --kl_estimator k3 --normalize_reward
--no_advantage_std_norm --n_samples_per_prompt 8 --prompt_data some/prompts
"""
SEED_PPO = """
--ref_num_nodes 1 --ref_num_gpus_per_node 8 --reward_num_nodes 1 --reward_num_gpus_per_node 8
--critic_num_nodes 1 --critic_num_gpus_per_node 8 --actor_num_nodes 1 --actor_num_gpus_per_node 8
--vllm_num_engines 4 --vllm_tensor_parallel_size 2 --colocate_all_models --vllm_gpu_memory_utilization 0.5
--pretrain OpenRLHF/Llama-3-8b-sft-mixture --reward_pretrain OpenRLHF/Llama-3-8b-rm-700k
--save_path ./output/llama3-8b-rlhf --micro_train_batch_size 8 --train_batch_size 128
--micro_rollout_batch_size 16 --rollout_batch_size 1024 --max_epochs 1 --prompt_max_len 1024
--generate_max_len 1024 --zero_stage 3 --bf16 --actor_learning_rate 5e-7 --critic_learning_rate 9e-6
--init_kl_coef 0.01 --normalize_reward --gradient_checkpointing --packing_samples --vllm_enable_sleep
--deepspeed_enable_sleep --prompt_data some/prompts --flash_attn --save_steps 100 --save_hf_ckpt
--ckpt_path ./ckpt --use_wandb offline --wandb_project p --enforce_eager --enable_prefix_caching
--vllm_sync_backend gloo --ref_reward_offload
"""


def checked(cfg: PPOConfig) -> PPOConfig:
    """A parsed config (its flags validated by parse_config) whose inputs are there too (what the trainer checks)."""
    cfg.check_inputs()
    return cfg


def parse(text: str) -> PPOConfig:
    return parse_config(PPOConfig, shlex.split(text), "test")


def test_seed_commands_parse_and_validate():
    grpo = checked(parse(SEED_GRPO))
    assert grpo.algo.advantage_estimator == "group_norm" and grpo.algo.use_kl_loss
    assert grpo.rollout.vllm_num_engines == 4 and grpo.resources.colocate_all_models
    ppo = checked(parse(SEED_PPO))
    assert ppo.algo.advantage_estimator == "gae"
    assert ppo.model.gradient_checkpointing and ppo.data.packing_samples and ppo.rollout.vllm_enable_sleep
    assert ppo.resources.deepspeed_enable_sleep and ppo.save.save_hf_ckpt and ppo.rollout.vllm_sync_backend == "gloo"
    # OpenRLHF's default critic: the reward model when there is one, else the policy.
    assert critic_path(ppo) == "OpenRLHF/Llama-3-8b-rm-700k"


def test_derived_defaults():
    cfg = parse("--pretrain m --remote_rm_url r.py --eps_clip 0.3 --clip_eps_high 0.28")
    assert clip_range(cfg) == (0.3, 0.28)
    assert critic_path(cfg) == "m"
    assert loss_aggregation(cfg) == "token_mean"
    dr_grpo = parse("--advantage_estimator dr_grpo --n_samples_per_prompt 2")
    assert loss_aggregation(dr_grpo) == "seq_mean_token_sum_norm"
    assert needs_reference(cfg)
    assert not needs_reference(parse("--init_kl_coef 0"))
    assert needs_reference(parse("--init_kl_coef 0 --use_kl_loss"))


@pytest.fixture
def rm_file(tmp_path):
    path = tmp_path / "reward.py"
    path.write_text("def reward_func(queries, prompts, labels):\n    return [0.0] * len(queries)\n")
    return str(path)


BASE = "--pretrain m --prompt_data p.jsonl --rollout_batch_size 4 --n_samples_per_prompt 2 --train_batch_size 8 " \
       "--micro_train_batch_size 4 --micro_rollout_batch_size 4 "


@pytest.mark.parametrize("flags, message", [
    ("--advantage_estimator group_norm --n_samples_per_prompt 1 --train_batch_size 4",
     "needs --n_samples_per_prompt > 1"),
    ("--advantage_estimator rloo --n_samples_per_prompt 1 --train_batch_size 4", "needs --n_samples_per_prompt > 1"),
    ("--advantage_estimator dr_grpo --n_samples_per_prompt 1 --train_batch_size 4",
     "needs --n_samples_per_prompt > 1"),
    ("--advantage_estimator reinforce_baseline --n_samples_per_prompt 1 --train_batch_size 4",
     "needs --n_samples_per_prompt > 1"),
    ("--train_batch_size 16", "is not divisible by --train_batch_size 16"),
    ("--micro_train_batch_size 3", "is not divisible by --micro_train_batch_size 3"),
    ("--micro_rollout_batch_size 3", "not divisible by --micro_rollout_batch_size 3"),
    ("--actor_num_gpus_per_node 4", "actor devices 4"),
    ("--dual_clip 1.0", "--dual_clip must be > 1"),
    ("--dual_clip 3 --policy_loss_type cispo", "--policy_loss_type cispo has none, drop --dual_clip"),
    ("--policy_loss_type sapo --tau_neg 0", "--tau_pos and --tau_neg must be > 0"),
    ("--learning_rate 1e-5", "--learning_rate does not apply to RL"),
    ("--temperature 0", "--temperature must be > 0"),
    ("--top_p 1.5", "--top_p must be in (0, 1]"),
    ("--kl_target -1", "--kl_target and --kl_horizon must be > 0"),
    ("--reward_clip_range 1 2 3", "--reward_clip_range takes one or two numbers"),
    ("--colocate_all_models --vllm_num_engines 2", "--colocate_all_models needs actor devices"),
    ("--enable_vllm_is_correction --vllm_is_truncated_threshold 2 1", "need 0 <= LO < HI"),
    ("--enable_vllm_is_correction --vllm_is_truncated_threshold 1 2 3", "takes LO HI or one cap"),
    ("--overlong_buffer_len 2000 --generate_max_len 1024", "--overlong_buffer_len must be in (0, "),
    ("--stop_properly_penalty_coef 2", "--stop_properly_penalty_coef must be <= 1"),
    ("--dynamic_filtering --dynamic_filtering_reward_range 1 0", "takes LO HI with LO < HI"),
    ("--dynamic_filtering --n_samples_per_prompt 1 --train_batch_size 4 --advantage_estimator reinforce",
     "--dynamic_filtering compares the samples of one prompt"),
    ("--enable_ema --ema_beta 1", "--ema_beta must be in (0, 1)"),
    ("--best_metric_key pass@1", "only eval metrics can pick the best model"),
    ("--best_metric_key eval/pass@1", "needs --eval_dataset"),
    ("--reward_workers 0", "--reward_workers must be >= 1"),
    ("--reward_timeout 0", "--reward_timeout must be > 0 seconds"),
    ("--reward_fallback nan", "--reward_fallback must be a finite number"),
    ("--max_reward_failure_ratio 1.5", "--max_reward_failure_ratio must be in [0, 1]"),
    ("--max_steps 3", "--max_steps 3 is the turn budget of an agent episode and needs --agent_func_path; to stop "
                      "after N RL steps use --max_rl_steps N"),
    (f"--agent_func_path {Path(__file__).parents[2] / 'examples' / 'agent_func_math.py'} --max_steps 3",
     "--agent_func_path: the agent's step rewards are the reward; drop --reward_pretrain / --remote_rm_url"),
    # the flag conflict (an agent and --remote_rm_url) is found at parse time, before the file is looked for
    ("--agent_func_path nope.py", "--agent_func_path: the agent's step rewards are the reward"),
])
def test_invalid_settings_exit_2_with_one_line(capsys, rm_file, flags, message):
    code = run_cli(main, shlex.split(BASE + f"--remote_rm_url {rm_file} " + flags), prog="train_ppo")
    err = without_startup_notes(capsys.readouterr().err)
    assert code == 2
    assert message in err
    assert err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize("flags, message", [
    (BASE, "no reward source"),
    (BASE + "--remote_rm_url missing_file.py", "not an http(s) URL and not an existing .py file"),
    (BASE + "--remote_rm_url http://a:1/x --reward_pretrain rm", "either --reward_pretrain or --remote_rm_url"),
    ("--remote_rm_url http://a:1/x --prompt_data p", "--pretrain is required"),
    ("--remote_rm_url http://a:1/x --pretrain m", "--prompt_data is required"),
    (BASE + "--remote_rm_url http://a:1/x --advantage_estimator unknown", "invalid choice"),
])
def test_missing_sources_exit_2(capsys, flags, message):
    try:
        code = run_cli(main, shlex.split(flags), prog="train_ppo")
    except SystemExit as e:  # argparse's own errors (unknown choice) exit from the parser
        code = e.code
    err = without_startup_notes(capsys.readouterr().err)
    assert code == 2 and message in err and err.count("\n") == 1


def test_good_config_passes_validation(rm_file):
    cfg = parse(BASE + f"--remote_rm_url {rm_file} --advantage_estimator rloo")
    assert checked(cfg) is cfg


def test_is_threshold_one_value_is_a_cap_and_two_are_bounds(rm_file):
    from rlhfkit.config.rl import is_bounds

    base = BASE + f"--remote_rm_url {rm_file} --enable_vllm_is_correction "
    assert is_bounds(checked(parse(base))) == (0.5, 5.0)  # OpenRLHF 0.11's default band
    assert is_bounds(checked(parse(base + "--vllm_is_truncated_threshold 3"))) == (0.0, 3.0)
    cfg = checked(parse(base + "--vllm_is_truncated_threshold 0.5 5 --vllm_is_correction_type icepop "
                                          "--policy_loss_type gspo"))
    assert is_bounds(cfg) == (0.5, 5.0) and cfg.algo.vllm_is_correction_type == "icepop"


def test_sapo_temperatures_reach_the_actor_spec(rm_file):
    from rlhfkit.config.rl_specs import actor_spec

    spec = actor_spec(checked(parse(BASE + f"--remote_rm_url {rm_file} --policy_loss_type sapo --tau_pos 0.5")))
    assert (spec.policy_loss_type, spec.tau_pos, spec.tau_neg) == ("sapo", 0.5, 1.05)
