"""The rules of --ring_attn_size / --ring_head_stride (rlhfkit.config.sequence_parallel): what parses, what stops
with one line (UserError, exit 2), including a ring size that divides neither the world nor the heads."""

from __future__ import annotations

import pytest

from rlhfkit.config.base import parse_config
from rlhfkit.config.preference import DPOConfig, KTOConfig, RMConfig
from rlhfkit.config.rl import PPOConfig
from rlhfkit.config.sequence_parallel import check_ring_heads, check_ring_world
from rlhfkit.config.sft import SFTConfig
from rlhfkit.errors import UserError

RL_RING = ["--ring_attn_size", "2", "--actor_num_gpus_per_node", "2", "--advantage_estimator", "reinforce",
           "--init_kl_coef", "0"]


def test_openrlhf_spellings_set_the_ring_size():
    assert parse_config(SFTConfig, ["--ring_attn_size", "2"], "t").strategy.ring_attn_size == 2
    assert parse_config(RMConfig, ["--ring_attn_size", "2"], "t").strategy.ring_attn_size == 2
    dpo = parse_config(DPOConfig, ["--ds.ring_attn_size", "4", "--ds.ring_attn_head_stride", "1"], "t")
    assert (dpo.strategy.ring_attn_size, dpo.strategy.ring_head_stride) == (4, 1)
    # OpenRLHF's long-context commands pass --ring_head_stride 2: accepted, without effect (Ulysses has no ring)
    assert parse_config(SFTConfig, ["--ring_head_stride", "2"], "t").strategy.ring_head_stride == 2


def test_rl_groups_of_ring_size_in_every_role():
    """train_ppo_ray: each role's devices split into groups of --ring_attn_size; the batch rules count the
    data-parallel ranks (2 actor devices in one group: 1 data-parallel rank), packed and with a token budget."""
    cfg = parse_config(PPOConfig, [*RL_RING, "--init_kl_coef", "0.01", "--ref_num_gpus_per_node", "2",
                                   "--advantage_estimator", "gae", "--critic_num_gpus_per_node", "4",
                                   "--train_batch_size", "8", "--micro_train_batch_size", "2", "--packing_samples",
                                   "--use_dynamic_batch", "--max_tokens_per_gpu", "4096"], "t")
    assert cfg.strategy.ring_attn_size == 2


@pytest.mark.parametrize("config, flags, needle", [
    (SFTConfig, ["--ring_head_stride", "0"], "--ring_head_stride 0: must be at least 1"),
    (SFTConfig, ["--ring_attn_size", "0"], "--ring_attn_size 0: must be at least 1"),
    (SFTConfig, ["--ring_attn_size", "2", "--aux_loss_coef", "0.01"], "--aux_loss_coef with --ring_attn_size"),
    (DPOConfig, ["--ring_attn_size", "2", "--use_dynamic_batch", "--max_tokens_per_gpu", "4096"],
     "--use_dynamic_batch with --ring_attn_size"),
    (RMConfig, ["--ring_attn_size", "2", "--use_dynamic_batch", "--max_tokens_per_gpu", "4096"],
     "--use_dynamic_batch with --ring_attn_size"),
    (KTOConfig, ["--ring_attn_size", "2"], "--ring_attn_size is not supported by train_kto yet"),
    (PPOConfig, ["--ring_attn_size", "2"], "--ring_attn_size 2 does not divide the 1 actor ranks"),
    (PPOConfig, [*RL_RING, "--init_kl_coef", "0.01", "--ref_num_gpus_per_node", "3"],
     "--ring_attn_size 2 does not divide the 3 ref ranks"),
    (PPOConfig, [*RL_RING, "--teacher_url", "http://127.0.0.1:1"], "on-policy distillation"),
    (PPOConfig, [*RL_RING, "--aux_loss_coef", "0.01"], "--aux_loss_coef with --ring_attn_size"),
    (PPOConfig, [*RL_RING, "--actor_num_gpus_per_node", "4", "--train_batch_size", "4",
                 "--micro_train_batch_size", "4"], "actor devices / --ring_attn_size"),
])
def test_refused_combinations_name_the_flag(config, flags, needle):
    with pytest.raises(UserError) as err:
        parse_config(config, flags, "t")
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_ring_size_must_divide_world_and_heads():
    assert check_ring_world(2, 4) == 2 and check_ring_world(1, 3) == 3
    with pytest.raises(UserError, match="--ring_attn_size 3 does not divide the world size 4"):
        check_ring_world(3, 4)
    check_ring_heads(4, 8)
    with pytest.raises(UserError, match="--ring_attn_size 3 does not divide the model's 4 attention heads"):
        check_ring_heads(3, 4)


def test_strategy_stops_before_any_process_group_when_the_ring_does_not_divide_the_world(monkeypatch):
    from rlhfkit.distributed.strategy import DeepSpeedStrategy

    monkeypatch.setenv("WORLD_SIZE", "4")
    args = parse_config(SFTConfig, ["--ring_attn_size", "3", "--train_batch_size", "8",
                                    "--micro_train_batch_size", "1"], "t").strategy
    with pytest.raises(UserError, match="does not divide the world size 4"):
        DeepSpeedStrategy(args)
    monkeypatch.setenv("WORLD_SIZE", "4")  # ring 2 at world 4: 2 data-parallel ranks, 8 / (1 x 2) = 4 micro steps
    args = parse_config(SFTConfig, ["--ring_attn_size", "2", "--train_batch_size", "8",
                                    "--micro_train_batch_size", "1"], "t").strategy
    assert DeepSpeedStrategy(args).accumulation_steps == 4


def test_cli_stops_with_one_line_and_exit_2_when_the_ring_does_not_divide_the_world(monkeypatch, tmp_path, capsys):
    """The launcher's world size is known before any data or model loads: `make_strategy` stops the run."""
    from rlhfkit.cli.common import run_cli
    from rlhfkit.cli.train_sft import main as sft_main
    from tests.helpers import error_lines

    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.chdir(tmp_path)
    code = run_cli(sft_main, ["--pretrain", "m", "--dataset", "d.jsonl", "--ring_attn_size", "3",
                              "--train_batch_size", "4", "--micro_train_batch_size", "1"], prog="p")
    err = error_lines(capsys.readouterr().err)
    assert code == 2 and len(err) == 1 and "--ring_attn_size 3 does not divide the world size 4" in err[0], err
