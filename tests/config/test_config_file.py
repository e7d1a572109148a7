"""What a `--config` file, an output path and a layout-bound flag are allowed to do (issue 25 items 4, 6, 7): the
accepted side of the rules whose refusals tests/cli/test_bad_inputs_config_paths.py checks."""

from __future__ import annotations

import dataclasses

import pytest

from rlhfkit.config.base import field_names, parse_config, parse_config_given
from rlhfkit.config.paths import check_output_paths
from rlhfkit.config.rl import PPOConfig
from rlhfkit.config.rl_inert import VLLM_ENGINE_FLAGS
from rlhfkit.config.rl_sections import RolloutArgs
from rlhfkit.config.sft import SFTConfig
from rlhfkit.errors import UserError

PPO = ["--pretrain", "m", "--remote_rm_url", "r.py", "--advantage_estimator", "group_norm", "--n_samples_per_prompt",
       "2", "--rollout_batch_size", "4", "--train_batch_size", "8", "--micro_train_batch_size", "2",
       "--micro_rollout_batch_size", "2", "--init_kl_coef", "0"]


def from_yaml(tmp_path, text: str, *argv: str, cls: type = SFTConfig):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return parse_config_given(cls, ["--config", str(path), *argv], "t")


def test_yaml11_number_forms_are_numbers(tmp_path):
    cfg, _ = from_yaml(tmp_path, "learning_rate: 1e-3\nl2: 5E-2\nmax_norm: .5\n")
    assert (cfg.strategy.learning_rate, cfg.strategy.l2, cfg.strategy.max_norm) == (0.001, 0.05, 0.5)


@pytest.mark.parametrize("text, value", [("false", False), ('"false"', False), ("'False'", False), ("no", False),
                                         ('"true"', True), ("true", True), ("1", True)])
def test_boolean_spellings_are_booleans_and_count_as_given(tmp_path, text, value):
    cfg, given = from_yaml(tmp_path, f"bf16: {text}\n")
    assert cfg.model.bf16 is value and "bf16" in given  # given: the device default does not replace it


def test_values_convert_as_the_flags_text_does(tmp_path):
    cfg, _ = from_yaml(tmp_path, 'zero_stage: "3"\nadam_betas: [0.8, "0.9"]\nmax_len: 64\ninput_template: 5\n'
                                 "max_tokens_per_gpu: null\n")
    assert cfg.strategy.zero_stage == 3 and cfg.strategy.adam_betas == [0.8, 0.9]
    assert cfg.data.max_len == 64 and cfg.data.input_template == "5" and cfg.strategy.max_tokens_per_gpu is None


def test_command_line_overrides_a_bad_file_value_without_naming_the_file(tmp_path):
    cfg, _ = from_yaml(tmp_path, "lora_rank: 8\n", "--lora_rank", "4")
    assert cfg.model.lora_rank == 4
    with pytest.raises(UserError) as e:
        from_yaml(tmp_path, "lora_rank: 8\n", "--lora_rank", "-1")
    assert "c.yaml" not in str(e.value)  # the broken value came from the command line


def test_adapted_openrlhf_key_converts_its_items(tmp_path):
    cfg, _ = from_yaml(tmp_path, "actor:\n  eps_clip_low_high: ['0.2', 0.28]\n", *PPO, cls=PPOConfig)
    assert (cfg.algo.clip_eps_low, cfg.algo.clip_eps_high) == (0.2, 0.28)


def test_seed_bounds():
    assert parse_config(SFTConfig, ["--seed", str(2**32 - 1)], "t").strategy.seed == 2**32 - 1
    with pytest.raises(UserError, match="--seed 4294967296 is out of range"):
        parse_config(SFTConfig, ["--seed", str(2**32)], "t")


# -- outputs and inputs ------------------------------------------------------------------------------------------
def sft(tmp_path, **fields) -> SFTConfig:
    cfg = parse_config(SFTConfig, ["--pretrain", str(tmp_path / "model"), "--dataset", str(tmp_path / "d.jsonl"),
                                   "--save_path", str(tmp_path / "out")], "t")
    for name, value in fields.items():
        section = next(s for s in ("model", "data", "checkpoint", "logging") if hasattr(getattr(cfg, s), name))
        setattr(getattr(cfg, section), name, value)
    return cfg


def test_outputs_beside_inputs_and_inputs_inside_outputs_are_fine(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "d.jsonl").write_text("{}\n")
    check_output_paths(sft(tmp_path))
    # the data inside the run directory, a hub name, a split suffix and a URL are never taken for the output
    check_output_paths(sft(tmp_path, dataset=f"{tmp_path}/out/d.jsonl,org/name@train,{tmp_path}/d.jsonl@test"))
    check_output_paths(sft(tmp_path, save_path=str(tmp_path / "model_sft")))


def test_an_input_named_with_a_split_suffix_still_guards_its_path(tmp_path):
    (tmp_path / "d.jsonl").write_text("{}\n")
    with pytest.raises(UserError, match="--metrics_path .* is also the input --dataset"):
        check_output_paths(sft(tmp_path, dataset=f"{tmp_path}/d.jsonl@train",
                               metrics_path=str(tmp_path / "d.jsonl")))


def test_a_symlinked_output_is_its_target(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "model")
    with pytest.raises(UserError, match="is also the input --pretrain"):
        check_output_paths(sft(tmp_path, save_path=str(tmp_path / "link")))


# -- flags bound to a layout ---------------------------------------------------------------------------------------
def test_every_vllm_engine_flag_is_bound_to_the_engines():
    """The static rule: each vLLM flag of the rollout section is refused without engines, except the engine count
    and the weight-sync backend (which the Transformers engine actors of train_ppo_ray use too)."""
    vllm_fields = {f.name for f in dataclasses.fields(RolloutArgs)
                   if f.name.startswith("vllm_") or f.name in ("enforce_eager", "enable_prefix_caching")}
    assert vllm_fields - set(VLLM_ENGINE_FLAGS) == {"vllm_num_engines", "vllm_sync_backend"}
    inert = parse_config(PPOConfig, PPO, "t").inert_flags()
    assert set(VLLM_ENGINE_FLAGS) <= set(inert)
    assert set(inert) <= field_names(PPOConfig)  # every rule names a real flag


def test_companions_of_a_feature_that_is_off_are_refused_when_given():
    for extra, flag in ((["--vllm_is_truncated_threshold", "0.5", "3"], "vllm_is_truncated_threshold"),
                        (["--dynamic_filtering_max_rounds", "3"], "dynamic_filtering_max_rounds"),
                        (["--overlong_penalty_factor", "0.5"], "overlong_penalty_factor"),
                        (["--kl_horizon", "500"], "kl_horizon"), (["--value_clip", "0.3"], "value_clip")):
        with pytest.raises(UserError, match=f"^--{flag} (has no effect without|acts on the critic)"):
            parse_config(PPOConfig, [*PPO, *extra], "t")


@pytest.mark.parametrize("extra", [
    [],  # defaults are never refused, inert or not
    ["--vllm_num_engines", "1", "--vllm_enable_sleep", "--enforce_eager", "--vllm_gpu_memory_utilization", "0.5"],
    ["--vllm_sync_backend", "gloo"],  # the Transformers engine actors receive weights by it
    ["--colocate_actor_ref", "--use_kl_loss", "--init_kl_coef", "0.01"],
    ["--enable_vllm_is_correction", "--vllm_is_truncated_threshold", "0.5", "3", "--kl_target", "0.1",
     "--kl_horizon", "500", "--overlong_buffer_len", "2", "--overlong_penalty_factor", "0.5",
     "--critic_learning_rate", "1e-5", "--freezing_actor_steps", "1"],  # kept for shared commands / freezes the actor
    ["--ref_reward_offload", "--init_kl_coef", "0.01"],
    ["--advantage_estimator", "gae", "--n_samples_per_prompt", "1", "--rollout_batch_size", "8",
     "--save_value_network", "--colocate_critic_reward", "--reward_pretrain", "rm", "--remote_rm_url", ""],
])
def test_flags_that_act_in_their_layout_are_accepted(extra):
    parse_config(PPOConfig, [*PPO, *extra], "t")
