"""--backend: fsdp2 is chosen by that one flag; DeepSpeed-only flags given with it, and what it lacks, stop with one
line (exit 2 through the CLI)."""

from __future__ import annotations

import shlex

import pytest

from rlhfkit.config.backend import layout_name
from rlhfkit.config.base import parse_config
from rlhfkit.config.preference import DPOConfig
from rlhfkit.config.rl import PPOConfig
from rlhfkit.config.sft import SFTConfig
from rlhfkit.errors import UserError
from tests.config.test_common import RL


def parse(cls, flags: str):
    return parse_config(cls, shlex.split(flags), "test")


def test_fsdp2_takes_its_own_flags_and_deepspeed_stays_the_default():
    assert parse(SFTConfig, "").strategy.backend == "deepspeed"
    cfg = parse(DPOConfig, "--dataset d --backend fsdp2 --adam_offload --bf16 --gradient_checkpointing")
    assert cfg.strategy.backend == "fsdp2" and layout_name(cfg.strategy) == "FSDP2"
    assert layout_name(parse(SFTConfig, "--zero_stage 3").strategy) == "ZeRO-3"


@pytest.mark.parametrize("flags, message", [
    ("--zero_stage 3", "--zero_stage is a DeepSpeed flag"),
    ("--ds.zero_stage 2", "--zero_stage is a DeepSpeed flag"),  # OpenRLHF's spelling, even at the default value
    ("--zpg 2", "--zpg is a DeepSpeed flag"),
    ("--overlap_comm", "--overlap_comm is a DeepSpeed flag"),
    ("--grad_accum_dtype fp32", "--grad_accum_dtype is a DeepSpeed flag"),
    ("--use_ds_universal_ckpt", "already resume at another world size"),
    ("--optim muon", "--optim muon is not supported with --backend fsdp2"),
])
def test_bad_combinations_stop_with_one_line(flags, message):
    with pytest.raises(UserError, match=message) as raised:
        parse(SFTConfig, "--backend fsdp2 " + flags)
    assert "\n" not in str(raised.value)
    parse(SFTConfig, flags)  # fine on DeepSpeed


def test_rl_roles_take_fsdp2_but_not_a_lora_actor():
    assert layout_name(parse(PPOConfig, RL + "--backend fsdp2 --actor_num_gpus_per_node 2").strategy) == "FSDP2"
    with pytest.raises(UserError, match="--lora_rank is not supported with --backend fsdp2") as raised:
        parse(PPOConfig, RL + "--backend fsdp2 --lora_rank 4")
    assert "\n" not in str(raised.value)
    with pytest.raises(UserError, match="--zero_stage is a DeepSpeed flag"):
        parse(PPOConfig, RL + "--backend fsdp2 --zero_stage 3")
