"""--ds_tensor_parallel_size (and OpenRLHF's --ds.tensor_parallel_size): taken on --backend fsdp2 by SFT, RM, DPO
and KTO; a size that does not divide the world, the heads, KV heads or MLP width, another backend, LoRA or an RL
command stop with one line."""

from __future__ import annotations

import json
import shlex

import pytest

from rlhfkit.config.base import parse_config
from rlhfkit.config.preference import DPOConfig
from rlhfkit.config.rl import PPOConfig
from rlhfkit.config.sft import SFTConfig
from rlhfkit.config.tensor_parallel import shape_problem
from rlhfkit.errors import UserError
from tests.config.test_common import RL

LLAMA = {"num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 344}  # the demo model's


@pytest.fixture
def model(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    return tmp_path


def parse(cls, flags: str):
    return parse_config(cls, shlex.split(flags), "test")


def test_shape_problem_names_what_the_size_does_not_divide():
    assert shape_problem(2, LLAMA) is None
    assert shape_problem(4, LLAMA) == "the model's KV heads (2)"
    assert shape_problem(3, LLAMA) == "the model's attention heads (4)"
    assert shape_problem(2, {"num_attention_heads": 4, "intermediate_size": 342 + 1}) == \
        "the model's MLP intermediate size (343)"
    assert shape_problem(4, {"num_attention_heads": 8, "intermediate_size": 64}) is None  # KV heads = heads


def test_both_spellings_take_tensor_parallel_on_fsdp2(model, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    for flag in ("--ds_tensor_parallel_size 2", "--ds.tensor_parallel_size 2"):
        cfg = parse(SFTConfig, f"--pretrain {model} --backend fsdp2 {flag}")
        assert cfg.strategy.ds_tensor_parallel_size == 2
    assert parse(DPOConfig, f"--dataset d --pretrain {model} --backend fsdp2 --ds_tensor_parallel_size 2")


@pytest.mark.parametrize("world, flags, message", [
    (2, "--ds_tensor_parallel_size 2", "needs --backend fsdp2"),
    (2, "--ds.tensor_parallel_size 2 --zero_stage 3", "needs --backend fsdp2"),
    (4, "--backend fsdp2 --ds_tensor_parallel_size 3", "does not divide the world size \\(4\\)"),
    (4, "--backend fsdp2 --ds_tensor_parallel_size 4", "does not divide the model's KV heads \\(2\\)"),
    (2, "--backend fsdp2 --ds_tensor_parallel_size 2 --lora_rank 8", "does not take LoRA"),
    (2, "--backend fsdp2 --ds_tensor_parallel_size 0", "expected a positive size"),
    (4, "--backend fsdp2 --ds_tensor_parallel_size 2 --ring_attn_size 2", "do not combine yet"),
])
def test_bad_combinations_stop_with_one_line(model, monkeypatch, world, flags, message):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    with pytest.raises(UserError, match=message) as raised:
        parse(SFTConfig, f"--pretrain {model} {flags}")
    assert "\n" not in str(raised.value)


def test_rl_commands_refuse_tensor_parallel():
    with pytest.raises(UserError, match="covers SFT, RM, DPO and KTO so far, not the RL roles"):
        parse(PPOConfig, RL + "--ds_tensor_parallel_size 2")
