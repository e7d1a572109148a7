"""OpenRLHF's spellings of our flags: a current (0.10.2+, dotted) hybrid-engine PPO command parses to the same
config as the flat one; their flags without an equivalent fail with "not supported yet"; `--help`, config files
and the migration table know every spelling."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from rlhfkit.cli.common import run_cli
from rlhfkit.cli.train_ppo_ray import main as ppo_ray_main
from rlhfkit.cli.train_sft import main as sft_main
from rlhfkit.config import openrlhf_names as theirs
from rlhfkit.config.base import field_names, parse_config
from rlhfkit.config.docs import TABLES, load_config_class, render
from rlhfkit.config.preference import DPOConfig, KTOConfig, RMConfig, ServeRMConfig
from rlhfkit.config.rl import PPOConfig
from rlhfkit.config.sft import SFTConfig
from rlhfkit.errors import UserError
from tests.helpers import error_lines

MIGRATION = Path(__file__).resolve().parents[2] / "docs" / "migration.md"
CONFIGS = (SFTConfig, RMConfig, DPOConfig, KTOConfig, PPOConfig, ServeRMConfig)

# Written for this test after OpenRLHF's 0.10.2+ docs (hybrid engine: every role and the vLLM engines on the
# actor's GPUs, both sleep modes, a reward model, a critic).
DOTTED_HYBRID_PPO = r"""
--ref.num_nodes 1 --ref.num_gpus_per_node 4 --reward.num_nodes 1 --reward.num_gpus_per_node 4
--critic.num_nodes 1 --critic.num_gpus_per_node 4 --actor.num_nodes 1 --actor.num_gpus_per_node 4
--vllm.num_engines 2 --vllm.tensor_parallel_size 2 --train.colocate_all --vllm.gpu_memory_utilization 0.6
--actor.model_name_or_path ./sft-model --reward.model_name_or_path ./rm-model
--ckpt.output_dir ./out/ppo --ckpt.path ./out/ckpt --ckpt.save_hf --ckpt.save_steps 20 --ckpt.max_num 2
--ckpt.load_enable --train.batch_size 128 --train.micro_batch_size 4 --rollout.batch_size 64
--rollout.micro_batch_size 8 --rollout.n_samples_per_prompt 2 --train.max_epochs 1 --train.num_episodes 2
--data.max_samples 10000 --data.max_len 3072 --rollout.max_new_tokens 1024 --ds.zero_stage 3
--ds.param_dtype bf16 --actor.adam.lr 5e-7 --critic.adam.lr 9e-6 --algo.kl.init_coef 0.01 --algo.kl.estimator k1
--data.prompt_dataset ./prompts.jsonl --data.input_key context_messages --data.apply_chat_template
--reward.normalize_enable --actor.gradient_checkpointing_enable --ds.packing_samples --vllm.sync_backend nccl
--vllm.enforce_eager --vllm.enable_sleep --ds.enable_sleep --actor.eps_clip_low_high 0.2 0.28
--algo.advantage.estimator gae --algo.advantage.gamma 1.0 --algo.advantage.lambd 0.95 --critic.value_clip 0.4
--logger.logging_steps 1 --eval.steps 10 --logger.wandb.key offline --logger.wandb.project ppo --ds.adam_offload
"""
FLAT_HYBRID_PPO = r"""
--ref_num_nodes 1 --ref_num_gpus_per_node 4 --reward_num_nodes 1 --reward_num_gpus_per_node 4
--critic_num_nodes 1 --critic_num_gpus_per_node 4 --actor_num_nodes 1 --actor_num_gpus_per_node 4
--vllm_num_engines 2 --vllm_tensor_parallel_size 2 --colocate_all_models --vllm_gpu_memory_utilization 0.6
--pretrain ./sft-model --reward_pretrain ./rm-model
--save_path ./out/ppo --ckpt_path ./out/ckpt --save_hf_ckpt --save_steps 20 --max_ckpt_num 2
--load_checkpoint --train_batch_size 128 --micro_train_batch_size 4 --rollout_batch_size 64
--micro_rollout_batch_size 8 --n_samples_per_prompt 2 --max_epochs 1 --num_episodes 2
--max_samples 10000 --prompt_max_len 2048 --generate_max_len 1024 --zero_stage 3
--bf16 --actor_learning_rate 5e-7 --critic_learning_rate 9e-6 --init_kl_coef 0.01 --kl_estimator k1
--prompt_data ./prompts.jsonl --input_key context_messages --apply_chat_template
--normalize_reward --gradient_checkpointing --packing_samples --vllm_sync_backend nccl
--enforce_eager --vllm_enable_sleep --deepspeed_enable_sleep --clip_eps_low 0.2 --clip_eps_high 0.28
--advantage_estimator gae --gamma 1.0 --lambd 0.95 --value_clip 0.4
--logging_steps 1 --eval_steps 10 --use_wandb offline --wandb_project ppo --adam_offload
"""


def argv(text: str) -> list[str]:
    return shlex.split(text)


def test_dotted_hybrid_engine_ppo_command_equals_the_flat_one():
    dotted = parse_config(PPOConfig, argv(DOTTED_HYBRID_PPO), "t")
    flat = parse_config(PPOConfig, argv(FLAT_HYBRID_PPO), "t")
    assert dotted == flat
    # and neither is the default config: the flags acted
    assert flat != PPOConfig() and flat.resources.colocate_all_models and flat.data.prompt_max_len == 2048
    assert (flat.algo.clip_eps_low, flat.algo.clip_eps_high) == (0.2, 0.28) and flat.model.bf16


def test_renamed_flat_flags():
    cfg = parse_config(PPOConfig, argv("--eps_clip_low_high 0.1 0.3 --param_dtype bf16"), "t")
    assert (cfg.algo.clip_eps_low, cfg.algo.clip_eps_high, cfg.model.bf16) == (0.1, 0.3, True)
    sft = parse_config(SFTConfig, argv("--model.model_name_or_path m --adam.lr 2e-5 --data.max_len 64 "
                                       "--ds.lora.target_modules all-linear --optim adam"), "t")
    assert (sft.model.pretrain, sft.strategy.learning_rate, sft.data.max_len) == ("m", 2e-5, 64)
    assert sft.model.target_modules is None
    lora = parse_config(SFTConfig, argv("--ds.lora.target_modules q_proj v_proj"), "t")
    assert lora.model.target_modules == ["q_proj", "v_proj"]


def test_fsdp2_branch_flags_select_fsdp2_and_map_to_ours():
    """OpenRLHF's FSDP2 branch (PR 1176): each FSDP2 flag is --backend fsdp2 plus our flag for the same thing."""
    rl = ("--advantage_estimator group_norm --n_samples_per_prompt 2 --actor_num_gpus_per_node 2 "
          "--ref_num_gpus_per_node 2 ")
    cfg = parse_config(PPOConfig, argv(rl + "--fsdp2_enable_sleep --fsdp2_cpu_offload --fsdp2_cp_size 2 "
                                            "--fsdp2_reshard_after_forward"), "t")
    ours = parse_config(PPOConfig, argv(rl + "--backend fsdp2 --deepspeed_enable_sleep --adam_offload "
                                             "--ring_attn_size 2"), "t")
    assert cfg == ours and cfg.strategy.backend == "fsdp2"
    sft = parse_config(SFTConfig, argv("--fsdp2_tp_size 1 --fsdp2_cpu_offload"), "t")
    assert (sft.strategy.backend, sft.strategy.ds_tensor_parallel_size, sft.strategy.adam_offload) == ("fsdp2", 1, True)
    with pytest.raises(UserError, match="--fsdp2_cpu_offload and --backend both set backend"):
        parse_config(SFTConfig, argv("--backend deepspeed --fsdp2_cpu_offload"), "t")
    with pytest.raises(UserError, match="--zero_stage is a DeepSpeed flag"):
        parse_config(PPOConfig, argv("--zero_stage 3 --fsdp2_enable_sleep"), "t")
    for flag in ("--no-fsdp2_reshard_after_forward", "--fsdp2_tp_loss_parallel", "--disable_fsdp2_ckpt"):
        with pytest.raises(UserError, match=f"{flag} is not supported yet"):
            parse_config(SFTConfig, [flag], "t")


def test_boolean_aliases_are_booleans():
    assert parse_config(PPOConfig, ["--train.colocate_all", "--ds.zero_stage", "1"], "t").resources.colocate_all_models
    assert not parse_config(PPOConfig, [], "t").resources.colocate_all_models
    dpo = parse_config(DPOConfig, ["--model.ipo_enable", "--ref.offload"], "t")
    assert dpo.train.ipo and dpo.reference.ref_offload
    assert parse_config(PPOConfig, ["--ref.offload"], "t").resources.ref_reward_offload
    with pytest.raises(SystemExit):  # a store_true flag takes no value
        parse_config(PPOConfig, ["--algo.kl.use_loss", "true"], "t")


@pytest.mark.parametrize("main, flags, needle", [
    (ppo_ray_main, ["--ds.ring_attn_size", "2"], "--ring_attn_size 2 does not divide the 1 actor ranks"),
    (ppo_ray_main, ["--ds.param_dtype", "fp16"], "--ds.param_dtype fp16 is not supported yet"),
    (ppo_ray_main, ["--ds.use_liger_kernel"], "--use_liger_kernel needs a CUDA GPU"),
    (sft_main, ["--data.prompt_dataset", "p.jsonl"], "--data.prompt_dataset is not supported yet by rlhfkit (this"),
])
def test_unsupported_flags_fail_with_one_line(main, flags, needle, capsys):
    code = run_cli(main, flags, prog="p")
    err = error_lines(capsys.readouterr().err)
    assert code == 2 and len(err) == 1 and needle in err[0], err
    assert "unrecognized" not in err[0]


def test_conflicting_spellings_fail():
    with pytest.raises(UserError, match="--data.max_len and --prompt_max_len both set"):
        parse_config(PPOConfig, argv("--data.max_len 100 --prompt_max_len 20 --generate_max_len 50"), "t")
    with pytest.raises(UserError, match="leaves no room for the prompt"):
        parse_config(PPOConfig, argv("--data.max_len 100 --rollout.max_new_tokens 100"), "t")


def test_help_lists_the_aliases(capsys):
    with pytest.raises(SystemExit) as exc:
        ppo_ray_main(["--help"])
    out = capsys.readouterr().out
    assert exc.value.code == 0
    for flag in ("--pretrain PRETRAIN, --actor.model_name_or_path PRETRAIN", "--train.colocate_all",
                 "--algo.kl.use_loss", "--ds.zero_stage", "--vllm.num_engines", "--ckpt.load_enable",
                 "--ckpt.output_dir", "--eps_clip_low_high LO HI", "--train.agent_func_path"):
        assert flag in out, flag


def test_config_file_with_nested_and_dotted_openrlhf_keys(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("actor:\n  model_name_or_path: m\n  adam:\n    lr: 1.0e-6\n  eps_clip_low_high: [0.1, 0.3]\n"
                    "train.colocate_all: true\nds.zero_stage: 1\nstrategy:\n  seed: 7\n"
                    "algo: {kl: {use_loss: true, estimator: k3}}\nrollout_batch_size: 4\n"
                    "train_batch_size: 4\nmicro_train_batch_size: 2\nmicro_rollout_batch_size: 2\n")
    cfg = parse_config(PPOConfig, ["--config", str(path), "--ds.zero_stage", "3"], "t")
    assert (cfg.model.pretrain, cfg.algo.actor_learning_rate, cfg.resources.colocate_all_models) == ("m", 1e-6, True)
    assert (cfg.algo.clip_eps_low, cfg.algo.clip_eps_high) == (0.1, 0.3)
    assert (cfg.strategy.zero_stage, cfg.strategy.seed, cfg.rollout.rollout_batch_size) == (3, 7, 4)
    assert cfg.algo.use_kl_loss and cfg.algo.kl_estimator == "k3"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"ds": {"experts_implementation": "grouped_mm"}}))
    with pytest.raises(UserError, match="ds.experts_implementation is not supported yet by rlhfkit"):
        parse_config(PPOConfig, ["--config", str(bad)], "t")


def test_async_aliases():
    valid = argv("--rollout_batch_size 4 --train_batch_size 4 --micro_train_batch_size 4 --micro_rollout_batch_size 4 "
                 "--enable_vllm_is_correction")  # parsing validates: the other flags these need
    cfg = parse_config(PPOConfig, ["--train.async_enable", "--train.async_queue_size", "3",
                                   "--train.partial_rollout_enable", "--rollout.vllm_generate_batch_size", "8",
                                   *valid], "t")
    a = cfg.asynchronous
    assert (a.async_train, a.async_queue_size, a.partial_rollout, a.vllm_generate_batch_size) == (True, 3, True, 8)


def test_recipe_aliases():
    """The 2025 recipes' dotted spellings set the flags that landed with them (none is "not supported")."""
    cfg = parse_config(PPOConfig, argv(
        "--algo.dynamic_filtering_enable --algo.dynamic_filtering_range 0.1 0.9 --reward.overlong_buffer_len 4 "
        "--reward.overlong_penalty_factor 0.5 --reward.stop_properly_penalty_coef 0.2 --train.enable_ema "
        "--train.ema_beta 0.9 --ckpt.best_metric_key eval/pass@1 --actor.policy_loss_type gspo "
        "--algo.advantage.is_correction_enable --algo.advantage.is_correction_type icepop "
        "--algo.advantage.is_correction_threshold 0.5 2.0 --train.agent_func_path a.py "
        "--train.dynamic_batch_enable --train.max_tokens_per_gpu 512 "
        # parsing validates: the other flags these need
        "--prompt_max_len 256 --generate_max_len 256 --n_samples_per_prompt 2 --eval_dataset e.jsonl"), "t")
    r, a = cfg.recipe, cfg.algo
    assert (r.dynamic_filtering, r.dynamic_filtering_reward_range) == (True, [0.1, 0.9])
    assert (r.overlong_buffer_len, r.overlong_penalty_factor, r.stop_properly_penalty_coef) == (4, 0.5, 0.2)
    assert (cfg.save.enable_ema, cfg.save.ema_beta, cfg.save.best_metric_key) == (True, 0.9, "eval/pass@1")
    assert (a.policy_loss_type, a.enable_vllm_is_correction, a.vllm_is_correction_type) == ("gspo", True, "icepop")
    assert a.vllm_is_truncated_threshold == [0.5, 2.0]
    assert cfg.agent.agent_func_path == "a.py"
    assert (cfg.strategy.use_dynamic_batch, cfg.strategy.max_tokens_per_gpu) == (True, 512)


def test_alias_table_is_consistent():
    every_field = set().union(*(field_names(c) for c in CONFIGS))
    for flag, target in theirs.ALIASES.items():
        targets = (target,) if isinstance(target, str) else target
        assert all(t in every_field for t in targets), flag
    for a in theirs.ADAPTED:
        assert all(f in every_field for f in (*a.fields, *a.needs)), a.flag
    spelled = set(theirs.ALIASES) | {a.flag for a in theirs.ADAPTED}
    assert not spelled & set(theirs.NOT_SUPPORTED)
    # every CLI parses with every alias that applies to it
    for cls in CONFIGS:
        fields = field_names(cls)
        for flag in theirs.ALIASES:
            handled = theirs.alias_target(flag, fields) or theirs.adapted_for(flag, fields)
            assert handled or theirs.not_supported_reason(flag, fields), (cls, flag)


def test_migration_table_is_current_and_complete():
    text = MIGRATION.read_text()
    assert render(text) == text, "run: python -m rlhfkit.config.docs docs/migration.md"
    for marker, spec in TABLES.items():
        cls = load_config_class(spec)
        assert f"<!-- migration:{marker} -->" in text
        for name in field_names(cls):
            assert f"| `--{name}` |" in text, (marker, name)
    for flag in (*theirs.ALIASES, *theirs.NOT_SUPPORTED, *(a.flag for a in theirs.ADAPTED if a.fields)):
        assert f"`--{flag}`" in text, flag


def test_unknown_dotted_flag_points_at_the_migration_table(capsys):
    with pytest.raises(SystemExit) as exc:
        parse_config(SFTConfig, ["--actor.no_such_flag", "1.5"], "p")
    err = error_lines(capsys.readouterr().err)
    assert exc.value.code == 2 and len(err) == 1 and "docs/migration.md" in err[0]
    with pytest.raises(SystemExit):
        parse_config(SFTConfig, ["--no_such_flag", "1.5"], "p")
    assert "migration" not in capsys.readouterr().err


def test_command_line_overrides_a_config_file_in_any_spelling(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("actor.eps_clip_low_high: [0.1, 0.3]\nrollout:\n  max_new_tokens: 40\n")
    cfg = parse_config(PPOConfig, ["--config", str(path), "--clip_eps_low", "0.2", "--data.max_len", "100"], "t")
    assert (cfg.algo.clip_eps_low, cfg.algo.clip_eps_high, cfg.data.prompt_max_len) == (0.2, 0.3, 60)
