"""Validation of the shared flags: --use_dynamic_batch / --max_tokens_per_gpu for every trainer's config."""

from __future__ import annotations

import shlex

import pytest

from rlhfkit.config.base import parse_config
from rlhfkit.config.preference import DPOConfig, KTOConfig, RMConfig
from rlhfkit.config.rl import PPOConfig
from rlhfkit.config.sft import SFTConfig
from rlhfkit.errors import UserError

RL = "--pretrain p --prompt_data d --remote_rm_url http://x/get_reward --advantage_estimator group_norm " \
     "--n_samples_per_prompt 2 --rollout_batch_size 4 --train_batch_size 8 --micro_train_batch_size 2 " \
     "--micro_rollout_batch_size 2 --prompt_max_len 100 --generate_max_len 50 "


def check(cls, flags: str):
    """Parse (which runs the config's validate())."""
    return parse_config(cls, shlex.split(flags), "test")


def test_token_budget_must_hold_the_longest_sample():
    cfg = check(PPOConfig, RL + "--use_dynamic_batch --max_tokens_per_gpu 150")
    assert cfg.strategy.use_dynamic_batch and cfg.strategy.max_tokens_per_gpu == 150
    with pytest.raises(UserError, match=r"--max_tokens_per_gpu 149 .*150 tokens: --prompt_max_len \+ "):
        check(PPOConfig, RL + "--use_dynamic_batch --max_tokens_per_gpu 149")
    check(SFTConfig, "--max_len 64 --use_dynamic_batch --max_tokens_per_gpu 64")
    with pytest.raises(UserError, match="--max_len"):
        check(SFTConfig, "--max_len 64 --use_dynamic_batch --max_tokens_per_gpu 63")
    # A preference pair is two rows.
    check(RMConfig, "--dataset d --max_len 64 --use_dynamic_batch --max_tokens_per_gpu 128")
    with pytest.raises(UserError, match="2 x --max_len"):
        check(DPOConfig, "--dataset d --max_len 64 --use_dynamic_batch --max_tokens_per_gpu 100")


def test_dynamic_batch_flags_never_act_alone_and_kto_refuses():
    with pytest.raises(UserError, match="needs --max_tokens_per_gpu"):
        check(SFTConfig, "--use_dynamic_batch")
    with pytest.raises(UserError, match="only applies with --use_dynamic_batch"):
        check(PPOConfig, RL + "--max_tokens_per_gpu 4096")
    with pytest.raises(UserError, match="not supported by train_kto"):
        check(KTOConfig, "--dataset d --use_dynamic_batch --max_tokens_per_gpu 4096")
