"""Every CLI config's validate(): run by parse_config, it holds each flag rule once (a section's own rules in the
section, the rules that join sections in the config), and fails with one line naming the flags; check_inputs()
holds what the run needs besides valid flags (required inputs, files), and the trainers call it."""

from __future__ import annotations

import shlex

import pytest

from rlhfkit.config.base import parse_config
from rlhfkit.config.batch_inference import BatchInferenceConfig
from rlhfkit.config.chat import ChatConfig
from rlhfkit.config.common import StrategyArgs, check_batch_split
from rlhfkit.config.lora_combiner import LoraCombinerConfig
from rlhfkit.config.preference import DPOConfig, KTOConfig, RMConfig, ServeRMConfig
from rlhfkit.config.rl import PPOConfig
from rlhfkit.config.sft import SFTConfig
from rlhfkit.errors import UserError

RL = ("--pretrain p --prompt_data d --remote_rm_url http://x/get_reward --rollout_batch_size 4 "
      "--n_samples_per_prompt 2 --train_batch_size 8 --micro_train_batch_size 2 --micro_rollout_batch_size 2 ")


def parse(cls, flags: str):
    return parse_config(cls, shlex.split(flags), "test")


def test_batch_split_is_one_rule_with_the_rank_count_as_input():
    assert check_batch_split(16, 2, 4) == 2  # 16 / (2 x 4) accumulation steps
    assert check_batch_split(16, 2, 1) == 8
    with pytest.raises(UserError, match=r"^--train_batch_size 16 is not divisible by --micro_train_batch_size 4 x "
                                        r"critic ranks 3 = 12; pick a multiple of 12$"):
        check_batch_split(16, 4, 3, "critic ranks")
    with pytest.raises(UserError, match="must be positive"):
        check_batch_split(0, 4, 1)


@pytest.mark.parametrize("flags, message", [
    ("--train_batch_size 10 --micro_train_batch_size 4", "--train_batch_size 10 is not divisible by "
                                                         "--micro_train_batch_size 4 x world size 1 = 4"),
    ("--micro_train_batch_size 0", "must be positive"),
    ("--use_dynamic_batch", "--use_dynamic_batch needs --max_tokens_per_gpu"),
    ("--max_tokens_per_gpu 64", "--max_tokens_per_gpu only applies with --use_dynamic_batch"),
    ("--use_dynamic_batch --max_tokens_per_gpu 0", "--max_tokens_per_gpu 0: must be at least 1 token"),
    ("--learning_rate 0", "--learning_rate 0.0: must be a positive finite number"),
    ("--lora_rank -1", "--lora_rank -1"),
    ("--flash_attn --attn_implementation eager", "--flash_attn asks for flash_attention_2"),
    ("--save_steps 0", "--save_steps 0"),
    ("--logging_steps 0", "--logging_steps 0"),
    ("--max_len 0", "--max_len 0"),
    ("--max_epochs 0", "--max_epochs 0: a run needs at least one epoch"),
    ("--max_steps 0", "--max_steps 0 trains nothing"),
    ("--aux_loss_coef -1", "--aux_loss_coef -1.0: must be >= 0"),
    ("--aux_loss_coef 0.01 --packing_samples", "--aux_loss_coef with --packing_samples is not supported"),
    ("--max_len 64 --use_dynamic_batch --max_tokens_per_gpu 63", "smaller than the longest possible sample (64 "
                                                                "tokens: --max_len)"),
])
def test_sft_validate_shared_sections_and_cross_field_rules(flags, message):
    with pytest.raises(UserError) as e:
        parse(SFTConfig, flags)
    assert message in str(e.value)


def test_sft_check_inputs_is_separate_from_the_flags():
    cfg = parse(SFTConfig, "--max_len 64 --use_dynamic_batch --max_tokens_per_gpu 64")  # no --dataset: flags fine
    with pytest.raises(UserError, match="--dataset is required"):
        cfg.check_inputs()
    parse(SFTConfig, "--dataset d.jsonl").check_inputs()


@pytest.mark.parametrize("cls, flags, message", [
    (RMConfig, "--aux_loss_coef 0.1", "--aux_loss_coef is not supported by train_rm"),
    (RMConfig, "--load_in_4bit", "--load_in_4bit is not supported by train_rm"),
    (RMConfig, "--max_len 64 --use_dynamic_batch --max_tokens_per_gpu 100", "2 x --max_len"),
    (DPOConfig, "--beta 0", "--beta must be > 0"),
    (DPOConfig, "--label_smoothing 0.5", "--label_smoothing must be in [0, 0.5)"),
    (DPOConfig, "--ipo --label_smoothing 0.1", "--label_smoothing (cDPO) does not apply to --ipo"),
    (DPOConfig, "--nll_loss_coef -1", "--nll_loss_coef must be >= 0"),
    (DPOConfig, "--margin_key m", "--margin_key applies to train_rm only"),
    (DPOConfig, "--loss_type simpo --ipo", "--loss_type simpo takes neither"),
    (DPOConfig, "--loss_type orpo --label_smoothing 0.1", "--loss_type orpo takes neither"),
    (DPOConfig, "--loss_type simpo --simpo_gamma -1", "--simpo_gamma must be >= 0"),
    (DPOConfig, "--loss_type orpo --nll_loss_coef 1", "already holds the chosen NLL term"),
    (DPOConfig, "--loss_type simpo --ref_pretrain r", "is reference-free and loads no reference model"),
    (DPOConfig, "--loss_type orpo --ref_offload", "is reference-free and loads no reference model"),
    (DPOConfig, "--max_epochs 0", "--max_epochs 0: a run needs at least one epoch"),
    (DPOConfig, "--aux_loss_coef 0.1 --packing_samples", "--aux_loss_coef with --packing_samples"),
    (KTOConfig, "--beta 0", "--beta must be > 0"),
    (KTOConfig, "--desirable_loss_weight -1", "must be >= 0"),
    (KTOConfig, "--micro_train_batch_size 1", "KTO needs --micro_train_batch_size >= 2"),
    (KTOConfig, "--use_dynamic_batch --max_tokens_per_gpu 4096", "not supported by train_kto"),
    (ServeRMConfig, "--port 70000", "--port 70000 is not a TCP port"),
    (ServeRMConfig, "--batch_wait_ms -1", "--batch_wait_ms must be >= 0"),
    (BatchInferenceConfig, "--zero_stage 3", "--zero_stage 3 (weights sharded over ranks) is not supported"),
    (BatchInferenceConfig, "--eval_task rm --best_of_n 2", "--eval_task rm only scores"),
    (BatchInferenceConfig, "--eval_task generate --tp_size 2", "apply to --eval_task generate_vllm only"),
    (BatchInferenceConfig, "--top_p 0", "--top_p must be in (0, 1]"),
    (BatchInferenceConfig, "--max_len 1", "--max_len must be at least 2"),
    (BatchInferenceConfig, "--csft_buckets 3", "apply to --post_processor csft only"),
    (BatchInferenceConfig, "--reward_pretrain r --remote_rm_url u", "not both"),
    (ChatConfig, "--apply_chat_template --input_template 'Q: {}'", "exclude each other"),
    (ChatConfig, "--tokenizer_chat_template t", "needs --apply_chat_template"),
    (ChatConfig, "--top_p 0", "--top_p in (0, 1]"),
    (ChatConfig, "--max_new_tokens 0", "--max_len 4096 must exceed --max_new_tokens 0 (>= 1)"),
    (ChatConfig, "--max_len 512", "--max_len 512 must exceed --max_new_tokens 512"),
    (ServeRMConfig, "--max_len 1", "--max_len must be at least 2"),
    (RMConfig, "--max_len 1", "--max_len 1: must be at least 2 tokens"),
    (LoraCombinerConfig, "--model_path m --lora_path l", "--output_path is required"),
])
def test_every_config_validates_its_flags_when_parsed(cls, flags, message):
    with pytest.raises(UserError) as e:
        parse(cls, flags)
    assert message in str(e.value)


@pytest.mark.parametrize("cls, flags, message", [
    (RMConfig, "", "--dataset is required: preference pairs"),
    (DPOConfig, "", "--dataset is required: preference pairs"),
    (KTOConfig, "", "--dataset is required: unpaired completions"),
    (ServeRMConfig, "", "--reward_pretrain is required"),
    (BatchInferenceConfig, "--dataset d --output_path o --pretrain m", "--eval_task is required"),
    (BatchInferenceConfig, "--eval_task generate --output_path o --pretrain m", "--dataset is required"),
])
def test_required_inputs_are_check_inputs_not_flag_rules(cls, flags, message):
    cfg = parse(cls, flags)
    with pytest.raises(UserError) as e:
        cfg.check_inputs()
    assert message in str(e.value)


@pytest.mark.parametrize("flags, message", [
    ("--actor_num_gpus_per_node 8", "--micro_train_batch_size 2 x actor devices 8 = 16"),
    ("--train_batch_size 16 --micro_train_batch_size 2", "is not divisible by --train_batch_size 16"),
    ("--advantage_estimator rloo --n_samples_per_prompt 1 --train_batch_size 4", "needs --n_samples_per_prompt > 1"),
    ("--dual_clip 1.0", "--dual_clip must be > 1"),
    ("--value_clip 0", "--value_clip must be > 0"),
    ("--kl_target 0.1 --kl_horizon 0", "--kl_target and --kl_horizon must be > 0"),
    ("--aux_loss_coef -0.5", "--aux_loss_coef -0.5: must be >= 0"),
    ("--aux_loss_coef 0.1 --packing_samples", "--aux_loss_coef with --packing_samples"),
    ("--critic_init_head", "--critic_init_head applies to the model given as --critic_pretrain"),
    ("--reward_pretrain rm", "pass either --reward_pretrain or --remote_rm_url, not both"),
    ("--max_steps 2", "needs --agent_func_path"),
    ("--reward_workers 0", "--reward_workers must be >= 1"),
    ("--use_dynamic_batch --max_tokens_per_gpu 10", "--prompt_max_len + --generate_max_len"),
])
def test_rl_validate_cross_field_rules(flags, message):
    with pytest.raises(UserError) as e:
        parse(PPOConfig, RL + flags)
    assert message in str(e.value)


def test_rl_check_inputs_reads_files_and_required_flags(tmp_path):
    assert parse(PPOConfig, "").algo.advantage_estimator == "gae"  # nothing given: the flags are all fine
    with pytest.raises(UserError, match="--pretrain is required"):
        parse(PPOConfig, "").check_inputs()
    with pytest.raises(UserError, match="--remote_rm_url nope.py: not an http"):
        parse(PPOConfig, RL.replace("http://x/get_reward", "nope.py")).check_inputs()
    with pytest.raises(UserError, match="--agent_func_path nope.py: not an existing .py file"):
        parse(PPOConfig, RL.replace("--remote_rm_url http://x/get_reward", "--agent_func_path nope.py")).check_inputs()
    with pytest.raises(UserError, match="no reward source"):
        parse(PPOConfig, RL.replace("--remote_rm_url http://x/get_reward", "")).check_inputs()
    parse(PPOConfig, RL).check_inputs()


def test_a_section_validates_itself_wherever_it_is_used():
    # StrategyArgs is shared by SFT, RM, DPO, KTO and PPO: its rules live in its validate(), run for each of them
    with pytest.raises(UserError, match="--max_tokens_per_gpu only applies"):
        StrategyArgs(max_tokens_per_gpu=8).validate()
    for cls in (SFTConfig, RMConfig, DPOConfig, KTOConfig, PPOConfig):
        with pytest.raises(UserError, match="--max_nonfinite_steps 0"):
            parse(cls, "--max_nonfinite_steps 0")
