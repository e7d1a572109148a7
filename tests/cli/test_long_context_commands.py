"""OpenRLHF's long-context RL commands pass validation (issue 20, acceptance 3): its 64k-token REINFORCE++ (its scripts
directory's `train_reinforce_baseline_hybrid_engine.sh`) and async-agent
(`train_reinforce_baseline_ray_agent_async.sh`) scripts, as of its DeepSpeed releases: flat flags (commit 8b78539c,
February 2026) and dotted flags (0.10.2+, commit ed62d0e2; in between, the length flags became --max_len /
--max_new_tokens); and their FSDP2 flags (OpenRLHF's FSDP2 branch, see SCRIPT_FSDP2). They are not among the seeds
(../shared/seeds), so their flags are written out here, the scripts' bash arrays joined in order.

Each flat command is scaled to the tiny demo model as the seed-command tests scale theirs (`scale` of
tests/cli/test_seed_commands.py), except the device counts: every role keeps a multiple of --ring_attn_size 2
devices (2), and the vLLM engines as many as the colocated actor has devices. The dotted commands parse (no flag
unknown or refused) to the same sequence-parallel and token-budget settings.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from rlhfkit.config.base import build_parser, parse_config
from rlhfkit.config.rl import PPOConfig

SCRIPT_FLAT = (
    "--pretrain MODEL --load_checkpoint --save_path SAVE --ckpt_path SAVE/ckpt --save_hf_ckpt --max_ckpt_num 3 "
    "--save_steps 10 --agent_func_path examples/python/agent_func.py --prompt_data DATA --input_key prompt "
    "--label_key label --prompt_max_len 10240 --generate_max_len 64000 --apply_chat_template --packing_samples "
    "--rollout_batch_size 128 --n_samples_per_prompt 8 --train_batch_size 1024 --dynamic_filtering "
    "--dynamic_filtering_reward_range 0.0 1.0 --use_dynamic_batch --train_max_tokens_per_gpu 16192 "
    "--rollout_max_tokens_per_gpu 32768 --micro_train_batch_size 1 --micro_rollout_batch_size 8 --max_samples 128000 "
    "--max_epochs 1 --num_episodes 1 {async_flags}--ref_num_nodes 1 --ref_num_gpus_per_node 4 --actor_num_nodes 1 "
    "--actor_num_gpus_per_node 4 --vllm_num_engines 2 --vllm_tensor_parallel_size 2 --vllm_gpu_memory_utilization 0.7 "
    "--colocate_all_models --deepspeed_enable_sleep --vllm_sync_backend nccl --enforce_eager --zero_stage 3 "
    "--gradient_checkpointing --ring_attn_size 2 --ring_head_stride 2 --param_dtype bf16 "
    "--advantage_estimator reinforce_baseline --actor_learning_rate 5e-7 --entropy_loss_coef 0.0 "
    "--init_kl_coef 1e-5 --use_kl_loss --kl_estimator k2 --enable_vllm_is_correction "
    "--vllm_is_correction_type icepop --use_tensorboard SAVE/runs --logging_steps 1 --eval_steps -1")
SCRIPT_DOTTED = (
    "--actor.model_name_or_path MODEL --ckpt.load_enable --ckpt.output_dir SAVE --ckpt.path SAVE/ckpt --ckpt.save_hf "
    "--ckpt.max_num 3 --ckpt.save_steps 10 --train.agent_func_path examples/python/agent_func.py "
    "--data.prompt_dataset DATA --data.input_key prompt --data.label_key label --data.max_len 74240 "
    "--rollout.max_new_tokens 64000 --data.apply_chat_template --ds.packing_samples --rollout.batch_size 128 "
    "--rollout.n_samples_per_prompt 8 --train.batch_size 1024 --algo.dynamic_filtering_enable "
    "--algo.dynamic_filtering_range 0.0 1.0 --train.dynamic_batch_enable --train.max_tokens_per_gpu 16192 "
    "--rollout.max_tokens_per_gpu 32768 --train.micro_batch_size 1 --rollout.micro_batch_size 8 "
    "--data.max_samples 128000 --train.max_epochs 1 --train.num_episodes 1 {async_flags}--ref.num_nodes 1 "
    "--ref.num_gpus_per_node 4 --actor.num_nodes 1 --actor.num_gpus_per_node 4 --vllm.num_engines 2 "
    "--vllm.tensor_parallel_size 2 --vllm.gpu_memory_utilization 0.7 --train.colocate_all --ds.enable_sleep "
    "--vllm.sync_backend nccl --vllm.enforce_eager --ds.zero_stage 3 --actor.gradient_checkpointing_enable "
    "--ds.ring_attn_size 2 --ds.ring_attn_head_stride 2 --ds.param_dtype bf16 "
    "--algo.advantage.estimator reinforce_baseline --actor.adam.lr 5e-7 --actor.entropy_coef 0.0 "
    "--algo.kl.init_coef 1e-5 --algo.kl.use_loss --algo.kl.estimator k2 --algo.advantage.is_correction_enable "
    "--algo.advantage.is_correction_type icepop --logger.tensorboard_dir SAVE/runs --logger.logging_steps 1 "
    "--eval.steps -1")
# OpenRLHF's FSDP2 branch (PR 1176, branch pr-1176-rebased-clean, commit 0c202eed, March 2026; in no release up
# to 0.11.0) runs the same scripts on FSDP2: --fsdp2_enable_sleep for --deepspeed_enable_sleep, --fsdp2_cp_size 2
# for --ring_attn_size 2, no --zero_stage. Its other renames in that branch (--model_name_or_path, --ckpt_save_path,
# --max_checkpoints_to_keep, --max_len / --max_new_tokens) stay in their released spellings here.
SCRIPT_FSDP2 = SCRIPT_FLAT.replace("--deepspeed_enable_sleep", "--fsdp2_enable_sleep").replace(
    "--zero_stage 3 ", "").replace("--ring_attn_size 2", "--fsdp2_cp_size 2")
# the async-agent script adds these to the 64k one (the dotted release also turns on partial rollout)
ASYNC = {"flat": "--async_train ", "dotted": "--train.async_enable --train.partial_rollout_enable ",
         "fsdp2": "--async_train "}
COMMANDS = {f"{script}-{form}": (text.format(async_flags=ASYNC[form] if script == "agent_async" else ""))
            for script in ("reinforce_64k", "agent_async")
            for form, text in (("flat", SCRIPT_FLAT), ("dotted", SCRIPT_DOTTED), ("fsdp2", SCRIPT_FSDP2))}


@pytest.mark.parametrize("name", [n for n in COMMANDS if not n.endswith("dotted")])
def test_openrlhf_long_context_commands_validate_scaled_to_the_tiny_model(name):
    from tests.cli.test_seed_commands import Block, _set, scale

    where = SimpleNamespace(model_dir="MODEL", rl_train="RL", sft_train="SFT")
    argv = scale(Block("openrlhf", 0, "train_ppo_ray", tuple(COMMANDS[name].split())), where, Path("OUT"))
    for flag in ("--actor_num_gpus_per_node", "--ref_num_gpus_per_node", "--vllm_num_engines"):
        _set(argv, flag, "2")  # a multiple of --ring_attn_size; 2 engines x TP 1 = the colocated actor's devices
    cfg = parse_config(PPOConfig, argv, "train_ppo_ray")
    assert (cfg.strategy.ring_attn_size, cfg.strategy.ring_head_stride) == (2, 2)
    assert (cfg.strategy.max_tokens_per_gpu, cfg.rollout.rollout_max_tokens_per_gpu) == (16192, 32768)
    assert cfg.asynchronous.async_train == ("agent_async" in name)
    # the FSDP2 form: every role on FSDP2, sleeping between its calls (the flat form: ZeRO-3, the same sleep)
    assert cfg.strategy.backend == ("fsdp2" if name.endswith("fsdp2") else "deepspeed")
    assert cfg.resources.deepspeed_enable_sleep


@pytest.mark.parametrize("name", [n for n in COMMANDS if n.endswith("dotted")])
def test_dotted_spellings_parse_to_the_same_settings(name):
    args = build_parser(PPOConfig, "train_ppo_ray").parse_args(COMMANDS[name].split())
    assert (args.ring_attn_size, args.ring_head_stride, args.use_dynamic_batch) == (2, 2, True)
    assert (args.max_tokens_per_gpu, args.rollout_max_tokens_per_gpu) == (16192, 32768)
    given = (getattr(args, "async_train", False), getattr(args, "partial_rollout", False))  # unset flags: absent
    assert given == ("agent_async" in name,) * 2
