"""Hostile input, round 3 (issue 25 items 4, 6, 7), one policy as tests/cli/test_bad_inputs.py: one line on stderr,
exit code 2, no traceback, before any work.

- `--config` values go through their flag's conversion, choices and rules, the file and key named;
- an output path that is an input, inside one, or under a regular file is refused (batch_inference, lora_combiner
  and the trainers);
- a flag that cannot act in the layout the other flags give (vLLM flags with no vLLM engine, colocation or
  offloading of a role the run does not have) fails with its reason.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.cli.test_bad_inputs import Case, assert_one_line_error, call_in_process, write
from tests.cli.test_bad_inputs import base_argv as trainer_argv


@pytest.fixture
def no_process_group():
    """As in test_bad_inputs: each case must fail before a process group is joined; none is left for the next."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    yield dist
    if dist.is_initialized():
        dist.destroy_process_group()


def base_argv(cli: str, a, tmp: Path) -> list[str]:
    """A valid command for each CLI, batch_inference and lora_combiner added (their outputs under tmp/save)."""
    if cli == "batch_inference":
        return ["--eval_task", "generate", "--pretrain", str(a.model_dir), "--dataset", str(a.rl_train),
                "--input_key", "prompt", "--max_new_tokens", "4", "--output_path", str(tmp / "save" / "out.jsonl")]
    if cli == "lora_combiner":
        return ["--model_path", str(a.model_dir), "--lora_path", str(tmp / "adapter"), "--output_path",
                str(tmp / "save" / "merged")]
    return trainer_argv(cli, a, tmp)


def config(tmp: Path, text: str, name: str = "c.yaml") -> list[str]:
    return ["--config", write(tmp / name, text)]


def copy_of(path: Path, tmp: Path) -> str:
    """A copy of an input under tmp (a case may aim an output at it: the original stays untouched either way)."""
    dst = tmp / "inputs" / path.name
    dst.parent.mkdir(parents=True, exist_ok=True)
    (shutil.copytree if path.is_dir() else shutil.copy)(path, dst)
    return str(dst)


def a_file(tmp: Path) -> Path:
    return Path(write(tmp / "notes.txt", "not a directory\n"))


PPO_RAY, NO_ENGINES = "train_ppo_ray", "is 0 (the Transformers engine generates)"
CASES = [
    # -- --config values: the flag's type, choices and rules, with the file and key named -------------------------
    Case("config_zero_stage_out_of_choices", "train_sft", lambda a, t: config(t, "zero_stage: 7\n"),
         ("c.yaml", "zero_stage", "invalid choice 7")),
    Case("config_adam_betas_one_number", "train_sft", lambda a, t: config(t, "adam_betas: 0.9\n"),
         ("--adam_betas 0.9", "two numbers", "c.yaml", "key adam_betas")),
    Case("config_lora_rank_negative_string", "train_sft", lambda a, t: config(t, 'lora_rank: "-4"\n'),
         ("--lora_rank -4", "c.yaml", "key lora_rank")),
    Case("config_seed_overflow", "train_sft", lambda a, t: config(t, "seed: 99999999999999999999\n"),
         ("--seed 99999999999999999999", "out of range", "c.yaml")),
    Case("config_bf16_not_a_boolean", "train_sft", lambda a, t: config(t, "bf16: maybe\n"),
         ("c.yaml", "bf16", "true or false")),
    Case("config_int_flag_given_a_float", "train_sft", lambda a, t: config(t, "max_len: 3.5\n"),
         ("c.yaml", "max_len", "invalid int value 3.5")),
    Case("config_int_flag_given_text", "train_dpo", lambda a, t: config(t, "max_epochs: two\n"),
         ("c.yaml", "max_epochs", "'two'")),
    Case("config_yaml11_negative_learning_rate", "train_sft", lambda a, t: config(t, "learning_rate: -1e-3\n"),
         ("--learning_rate -0.001", "positive", "c.yaml")),
    Case("config_null_for_a_number", "train_sft", lambda a, t: config(t, "max_len: null\n"),
         ("c.yaml", "max_len", "null")),
    Case("config_list_for_one_value", "train_rm", lambda a, t: config(t, "learning_rate: [1.0e-5, 2.0e-5]\n"),
         ("c.yaml", "learning_rate", "expected one value")),
    Case("config_json_bad_choice", "train_sft",
         lambda a, t: config(t, '{"lr_scheduler": "cosine_nope"}', "c.json"),
         ("c.json", "lr_scheduler", "invalid choice 'cosine_nope'")),
    Case("config_section_key_bad_type", "train_kto", lambda a, t: config(t, "strategy:\n  train_batch_size: eight\n"),
         ("c.yaml", "strategy.train_batch_size", "'eight'")),
    Case("config_openrlhf_dotted_key_bad_choice", "train_sft", lambda a, t: config(t, "ds:\n  zero_stage: 9\n"),
         ("c.yaml", "ds.zero_stage", "invalid choice 9")),
    Case("config_adapted_flag_bad_kind", "train_ppo",
         lambda a, t: config(t, "actor:\n  eps_clip_low_high: [low, high]\n"),
         ("c.yaml", "actor.eps_clip_low_high", "invalid float value")),
    Case("config_boolean_given_a_list", "train_sft", lambda a, t: config(t, "packing_samples: [true]\n"),
         ("c.yaml", "packing_samples", "true or false")),
    Case("config_yaml_boolean_for_a_text_flag", "train_sft", lambda a, t: config(t, "use_wandb: false\n"),
         ("c.yaml", "use_wandb", "YAML boolean false")),
    Case("config_yaml_boolean_for_a_number", "train_sft", lambda a, t: config(t, "max_len: yes\n"),
         ("c.yaml", "max_len", "expected a number")),
    Case("flag_seed_overflow", "train_rm", lambda a, t: ["--seed", "99999999999999999999"],
         ("--seed 99999999999999999999", "out of range")),
    Case("flag_seed_negative", "train_ppo", lambda a, t: ["--seed", "-1"], ("--seed -1", "out of range")),
    # -- outputs are never inputs ---------------------------------------------------------------------------------
    Case("output_is_the_batch_inference_dataset", "batch_inference",
         lambda a, t: (lambda d: ["--dataset", d, "--output_path", d])(copy_of(a.rl_train, t)),
         ("--output_path", "is also the input --dataset", "destroy")),
    Case("output_inside_the_batch_inference_dataset_directory", "batch_inference",
         lambda a, t: (lambda d: ["--dataset", str(Path(d).parent), "--output_path", str(Path(d).parent / "o.jsonl")])(
             copy_of(a.rl_train, t)),
         ("--output_path", "inside the input --dataset")),
    Case("output_under_a_regular_file_batch_inference", "batch_inference",
         lambda a, t: ["--output_path", str(a_file(t) / "out.jsonl")], ("--output_path", "is a file, not a directory")),
    Case("output_is_a_directory_batch_inference", "batch_inference",
         lambda a, t: ["--output_path", str(t)], ("--output_path", "is a directory")),
    Case("output_is_the_lora_combiner_base_model", "lora_combiner",
         lambda a, t: (lambda m: ["--model_path", m, "--output_path", m])(copy_of(a.model_dir, t)),
         ("--output_path", "is also the input --model_path")),
    Case("output_inside_the_lora_adapter", "lora_combiner",
         lambda a, t: (t / "adapter").mkdir() or ["--output_path", str(t / "adapter" / "merged")],
         ("--output_path", "inside the input --lora_path")),
    Case("output_under_a_regular_file_lora_combiner", "lora_combiner",
         lambda a, t: ["--output_path", str(a_file(t) / "merged")], ("--output_path", "is a file, not a directory")),
    Case("save_path_is_the_pretrained_model", "train_sft",
         lambda a, t: (lambda m: ["--pretrain", m, "--save_path", m])(copy_of(a.model_dir, t)),
         ("--save_path", "is also the input --pretrain")),
    Case("save_path_inside_the_pretrained_model", "train_dpo",
         lambda a, t: (lambda m: ["--pretrain", m, "--save_path", str(Path(m) / "out")])(copy_of(a.model_dir, t)),
         ("--save_path", "inside the input --pretrain")),
    Case("metrics_path_is_the_dataset", "train_rm",
         lambda a, t: (lambda d: ["--dataset", d, "--metrics_path", d])(copy_of(a.pref_train, t)),
         ("--metrics_path", "is also the input --dataset")),
    Case("ckpt_path_is_the_pretrained_model", "train_ppo",
         lambda a, t: (lambda m: ["--pretrain", m, "--ckpt_path", m])(copy_of(a.model_dir, t)),
         ("--ckpt_path", "is also the input --pretrain")),
    # -- flags that cannot act in the layout ----------------------------------------------------------------------
    Case("vllm_sleep_without_engines", PPO_RAY, lambda a, t: ["--vllm_enable_sleep"],
         ("--vllm_enable_sleep", NO_ENGINES)),
    Case("vllm_memory_without_engines", PPO_RAY, lambda a, t: ["--vllm_gpu_memory_utilization", "0.5"],
         ("--vllm_gpu_memory_utilization", NO_ENGINES)),
    Case("prefix_caching_without_engines", PPO_RAY, lambda a, t: ["--enable_prefix_caching"],
         ("--enable_prefix_caching", NO_ENGINES)),
    Case("enforce_eager_with_zero_engines", PPO_RAY, lambda a, t: ["--vllm_num_engines", "0", "--enforce_eager"],
         ("--enforce_eager", NO_ENGINES)),
    Case("vllm_tensor_parallel_without_engines", "train_ppo", lambda a, t: ["--vllm_tensor_parallel_size", "1"],
         ("--vllm_tensor_parallel_size", NO_ENGINES)),
    Case("colocate_actor_ref_without_reference", PPO_RAY, lambda a, t: ["--colocate_actor_ref"],
         ("--colocate_actor_ref", "this run has neither")),
    Case("colocate_critic_reward_without_either", PPO_RAY, lambda a, t: ["--colocate_critic_reward"],
         ("--colocate_critic_reward", "no critic", "nor reward model")),
    Case("ref_reward_offload_without_either", PPO_RAY, lambda a, t: ["--ref_reward_offload"],
         ("--ref_reward_offload", "this run has none")),
    Case("vllm_engines_in_the_single_process_run", "train_ppo", lambda a, t: ["--vllm_num_engines", "2"],
         ("--vllm_num_engines 2", "train_ppo runs every role in this process", "train_ppo_ray")),
    Case("save_value_network_without_critic", "train_ppo", lambda a, t: ["--save_value_network"],
         ("--save_value_network", "group_norm trains none")),
    Case("is_threshold_without_is_correction", "train_ppo",
         lambda a, t: ["--vllm_is_truncated_threshold", "0.5", "3"],
         ("--vllm_is_truncated_threshold", "no effect without --enable_vllm_is_correction")),
    Case("overlong_factor_without_buffer", PPO_RAY, lambda a, t: ["--overlong_penalty_factor", "0.5"],
         ("--overlong_penalty_factor", "no effect without --overlong_buffer_len")),
    Case("value_clip_without_critic", "train_ppo", lambda a, t: ["--value_clip", "0.3"],
         ("--value_clip", "acts on the critic")),
    Case("vllm_flag_from_config_without_engines", PPO_RAY,
         lambda a, t: config(t, "vllm:\n  enable_sleep: true\n"),
         ("--vllm_enable_sleep", NO_ENGINES, "c.yaml", "key vllm.enable_sleep")),
    Case("batch_inference_prefix_caching_without_vllm", "batch_inference",
         lambda a, t: ["--enable_prefix_caching"], ("--enable_prefix_caching", "generate_vllm only")),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case: Case, demo_assets, tmp_path, capsys, no_process_group):
    dist = no_process_group
    extra = case.argv(demo_assets, tmp_path)
    code, err = call_in_process(case.cli, [*base_argv(case.cli, demo_assets, tmp_path), *extra], capsys)
    assert_one_line_error(code, err, case.expect)
    assert not dist.is_initialized()  # refused before any process group was joined
    assert not (tmp_path / "save").exists() or not any((tmp_path / "save").iterdir())


def test_cases_are_distinct_and_enough():
    assert len({c.id for c in CASES}) == len(CASES) >= 25


def test_refused_output_leaves_the_input_as_it_was(demo_assets, tmp_path, capsys):
    """batch_inference --output_path = --dataset: refused, and the prompts file is byte for byte what it was."""
    data = copy_of(demo_assets.rl_train, tmp_path)
    before = Path(data).read_bytes()
    code, err = call_in_process("batch_inference", [*base_argv("batch_inference", demo_assets, tmp_path),
                                                    "--dataset", data, "--output_path", data], capsys)
    assert_one_line_error(code, err, ("--output_path",))
    assert Path(data).read_bytes() == before
    assert sorted(p.name for p in Path(data).parent.iterdir()) == [Path(data).name]  # no temporary file left
