"""OpenRLHF 0.11's default values, and the few that rlhfkit keeps its own (issue 24).

A command pasted from OpenRLHF should train the same when it leaves a flag out. `OPENRLHF` holds every default of
OpenRLHF 0.11.0's CLIs (train_sft, train_rm, train_dpo, train_ppo_ray and serve_rm; 0.11 has no train_kto), as
tools/openrlhf_defaults.py reads them from their argparse calls (expressions evaluated: `int(1e8)` is 100000000, a
run name built from the start time is "sft_(start time)"). rlhfkit's defaults (the config dataclasses) equal these,
flag for flag, through the spellings of `rlhfkit.config.openrlhf_names`, except:
- DIFFERENCES: defaults rlhfkit keeps on purpose, each with its one-line reason. A command that leaves such a flag
  out, where it matters, gets one line on stderr at start (`startup_notes`, printed by `rlhfkit.cli.common`):
  "rlhfkit: --host not given: 127.0.0.1 here, OpenRLHF uses 0.0.0.0 (docs/migration.md#defaults)".
- SAME_MEANING: their value spelled another way for the same behaviour (`None` vLLM engines, 0 here); no line.
Both are listed in docs/migration.md#defaults (`defaults_table`). OpenRLHF flags that rlhfkit does not implement
(`openrlhf_names.NOT_SUPPORTED`) fail when given, and behave as their default when not.
tests/config/test_openrlhf_defaults.py compares every default of every command with this table.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rlhfkit.config import openrlhf_names as theirs
from rlhfkit.config.base import field_defaults, field_names, field_values, iter_fields
from rlhfkit.errors import UserError

ANCHOR = "docs/migration.md#defaults"

# OpenRLHF 0.11 command -> rlhfkit's config class of the same command
COMMANDS = {
    "train_sft": "rlhfkit.config.sft:SFTConfig",
    "train_rm": "rlhfkit.config.preference:RMConfig",
    "train_dpo": "rlhfkit.config.preference:DPOConfig",
    "train_ppo_ray": "rlhfkit.config.rl:PPOConfig",
    "serve_rm": "rlhfkit.config.preference:ServeRMConfig",
}
# rlhfkit commands without an OpenRLHF 0.11 twin that parse the same config as one (train_ppo: train_ppo_ray's)
SAME_DEFAULTS_AS = {"train_ppo": "train_ppo_ray"}

# Written by `python tools/openrlhf_defaults.py openrlhf/cli/{train_sft,train_rm,train_dpo,train_ppo_ray,serve_rm}.py`
# from OpenRLHF 0.11.0.
OPENRLHF: dict[str, dict[str, Any]] = {
    "train_sft": {
        "adam.betas": [0.9, 0.95], "adam.eps": 1e-08, "adam.lr": 5e-06, "adam.weight_decay": 0.0,
        "ckpt.disable_ds": False, "ckpt.load_enable": False, "ckpt.max_mem": 100000000, "ckpt.max_num": 3,
        "ckpt.output_dir": './ckpt', "ckpt.path": './ckpt/checkpoints_sft', "ckpt.save_hf": False,
        "ckpt.save_steps": -1, "data.apply_chat_template": False, "data.dataloader_num_workers": 0,
        "data.dataset": None, "data.dataset_probs": None, "data.dataset_split": 'train',
        "data.disable_fast_tokenizer": False, "data.input_key": 'input',
        "data.input_template": 'User: {}\nAssistant: ', "data.max_len": 2048, "data.max_samples": 1000000,
        "data.multiturn": False, "data.output_key": None, "data.tokenizer_chat_template": None,
        "ds.adam_offload": False, "ds.attn_implementation": 'flash_attention_2', "ds.deepcompile": False,
        "ds.experts_implementation": None, "ds.grad_accum_dtype": None, "ds.load_in_4bit": False,
        "ds.lora.alpha": 16, "ds.lora.dropout": 0, "ds.lora.rank": 0, "ds.lora.target_modules": 'all-linear',
        "ds.overlap_comm": False, "ds.packing_samples": False, "ds.param_dtype": 'bf16',
        "ds.ring_attn_head_stride": 1, "ds.ring_attn_size": 1, "ds.tensor_parallel_size": 1,
        "ds.use_liger_kernel": False, "ds.use_universal_ckpt": False, "ds.zero_stage": 2, "ds.zpg": 1,
        "eval.dataset": None, "eval.split": 'train', "eval.steps": -1, "local_rank": -1, "logger.logging_steps": 1,
        "logger.tensorboard_dir": None, "logger.wandb.group": None, "logger.wandb.key": None,
        "logger.wandb.org": None, "logger.wandb.project": 'openrlhf_train_sft',
        "logger.wandb.run_name": 'sft_(start time)', "lr_scheduler": 'cosine_with_min_lr', "lr_warmup_ratio": 0.03,
        "max_norm": 1.0, "min_lr_ratio": 0.1, "model.aux_loss_coef": 0,
        "model.gradient_checkpointing_enable": False, "model.gradient_checkpointing_reentrant": False,
        "model.model_name_or_path": None, "model.pretrain_mode_enable": False, "muon.lr": 0.02,
        "muon.momentum": 0.95, "muon.nesterov": True, "muon.ns_steps": 5, "optim": 'adam', "train.batch_size": 128,
        "train.full_determinism_enable": False, "train.max_epochs": 2, "train.micro_batch_size": 8,
        "train.seed": 42, "use_ms": False,
    },
    "train_rm": {
        "adam.betas": [0.9, 0.95], "adam.eps": 1e-08, "adam.lr": 9e-06, "adam.weight_decay": 0.0,
        "ckpt.disable_ds": False, "ckpt.load_enable": False, "ckpt.max_mem": 100000000, "ckpt.max_num": 3,
        "ckpt.output_dir": './ckpt', "ckpt.path": './ckpt/checkpoints_rm', "ckpt.save_hf": False,
        "ckpt.save_steps": -1, "data.apply_chat_template": False, "data.chosen_key": 'chosen',
        "data.dataloader_num_workers": 0, "data.dataset": None, "data.dataset_probs": None,
        "data.dataset_split": 'train', "data.disable_fast_tokenizer": False, "data.input_template": None,
        "data.max_len": 512, "data.max_samples": 1000000, "data.prompt_key": None, "data.rejected_key": 'rejected',
        "data.tokenizer_chat_template": None, "ds.adam_offload": False,
        "ds.attn_implementation": 'flash_attention_2', "ds.deepcompile": False, "ds.experts_implementation": None,
        "ds.grad_accum_dtype": None, "ds.load_in_4bit": False, "ds.lora.alpha": 16, "ds.lora.dropout": 0,
        "ds.lora.rank": 0, "ds.lora.target_modules": 'all-linear', "ds.overlap_comm": False,
        "ds.packing_samples": False, "ds.param_dtype": 'bf16', "ds.ring_attn_head_stride": 1,
        "ds.ring_attn_size": 1, "ds.tensor_parallel_size": 1, "ds.use_universal_ckpt": False,
        "ds.value_head_prefix": 'score', "ds.zero_stage": 2, "ds.zpg": 1, "eval.dataset": None,
        "eval.split": 'train', "eval.steps": -1, "local_rank": -1, "logger.logging_steps": 1,
        "logger.tensorboard_dir": None, "logger.wandb.group": None, "logger.wandb.key": None,
        "logger.wandb.org": None, "logger.wandb.project": 'openrlhf_train_rm',
        "logger.wandb.run_name": 'rm_(start time)', "lr_scheduler": 'cosine_with_min_lr', "lr_warmup_ratio": 0.03,
        "max_norm": 1.0, "min_lr_ratio": 0.1, "model.aux_loss_coef": 0, "model.compute_fp32_loss_enable": False,
        "model.gradient_checkpointing_enable": False, "model.gradient_checkpointing_reentrant": False,
        "model.loss_type": 'sigmoid', "model.margin_loss_enable": False, "model.model_name_or_path": None,
        "muon.lr": 0.02, "muon.momentum": 0.95, "muon.nesterov": True, "muon.ns_steps": 5, "optim": 'adam',
        "train.batch_size": 128, "train.full_determinism_enable": False, "train.max_epochs": 1,
        "train.micro_batch_size": 1, "train.seed": 42, "use_ms": False,
    },
    "train_dpo": {
        "adam.betas": [0.9, 0.95], "adam.eps": 1e-08, "adam.lr": 1e-05, "adam.weight_decay": 0.0,
        "ckpt.disable_ds": False, "ckpt.load_enable": False, "ckpt.max_mem": 100000000, "ckpt.max_num": 3,
        "ckpt.output_dir": './ckpt', "ckpt.path": './ckpt/checkpoints_dpo', "ckpt.save_hf": False,
        "ckpt.save_steps": -1, "data.apply_chat_template": False, "data.chosen_key": 'chosen',
        "data.dataloader_num_workers": 0, "data.dataset": None, "data.dataset_probs": None,
        "data.dataset_split": 'train', "data.disable_fast_tokenizer": False, "data.input_template": None,
        "data.max_len": 512, "data.max_samples": 1000000, "data.prompt_key": None, "data.rejected_key": 'rejected',
        "data.tokenizer_chat_template": None, "ds.adam_offload": False,
        "ds.attn_implementation": 'flash_attention_2', "ds.deepcompile": False, "ds.experts_implementation": None,
        "ds.grad_accum_dtype": None, "ds.load_in_4bit": False, "ds.lora.alpha": 16, "ds.lora.dropout": 0,
        "ds.lora.rank": 0, "ds.lora.target_modules": 'all-linear', "ds.overlap_comm": False,
        "ds.packing_samples": False, "ds.param_dtype": 'bf16', "ds.ring_attn_head_stride": 1,
        "ds.ring_attn_size": 1, "ds.tensor_parallel_size": 1, "ds.use_liger_kernel": False,
        "ds.use_universal_ckpt": False, "ds.zero_stage": 2, "ds.zpg": 1, "eval.dataset": None, "eval.split": 'test',
        "eval.steps": -1, "local_rank": -1, "logger.logging_steps": 1, "logger.tensorboard_dir": None,
        "logger.wandb.group": None, "logger.wandb.key": None, "logger.wandb.org": None,
        "logger.wandb.project": 'openrlhf_train_dpo', "logger.wandb.run_name": 'exp_(start time)',
        "lr_scheduler": 'cosine_with_min_lr', "lr_warmup_ratio": 0.03, "max_norm": 1.0, "min_lr_ratio": 0.1,
        "model.aux_loss_coef": 0, "model.beta": 0.1, "model.gradient_checkpointing_enable": False,
        "model.gradient_checkpointing_reentrant": False, "model.ipo_enable": False, "model.label_smoothing": 0.0,
        "model.model_name_or_path": None, "model.nll_loss_coef": 0, "muon.lr": 0.02, "muon.momentum": 0.95,
        "muon.nesterov": True, "muon.ns_steps": 5, "optim": 'adam', "ref.model_name_or_path": None,
        "ref.offload": False, "train.batch_size": 128, "train.full_determinism_enable": False,
        "train.max_epochs": 1, "train.micro_batch_size": 8, "train.seed": 42, "use_ms": False,
    },
    "train_ppo_ray": {
        "actor.adam.betas": [0.9, 0.95], "actor.adam.eps": 1e-08, "actor.adam.lr": 1e-06,
        "actor.adam.weight_decay": 0.0, "actor.aux_loss_coef": 0, "actor.dual_clip": None,
        "actor.entropy_coef": None, "actor.eps_clip": 0.2, "actor.eps_clip_low_high": None,
        "actor.freeze_visual_encoder": False, "actor.gradient_checkpointing_enable": False,
        "actor.gradient_checkpointing_reentrant": False, "actor.lr_scheduler": 'cosine_with_min_lr',
        "actor.lr_warmup_ratio": 0.03, "actor.max_norm": 1.0, "actor.min_lr_ratio": 0.1,
        "actor.model_name_or_path": None, "actor.muon.lr": 0.02, "actor.muon.momentum": 0.95,
        "actor.muon.nesterov": True, "actor.muon.ns_steps": 5, "actor.num_gpus_per_node": 8, "actor.num_nodes": 1,
        "actor.optim": 'adam', "actor.policy_loss_type": 'ppo', "algo.advantage.estimator": 'gae',
        "algo.advantage.gamma": 1, "algo.advantage.is_correction_enable": False,
        "algo.advantage.is_correction_threshold": [0.5, 5.0], "algo.advantage.is_correction_type": 'tis',
        "algo.advantage.lambd": 1, "algo.advantage.no_std_norm": False, "algo.dynamic_filtering_enable": False,
        "algo.dynamic_filtering_range": [0, 1], "algo.kl.estimator": 'k1', "algo.kl.horizon": 10000,
        "algo.kl.init_coef": 0.01, "algo.kl.target": None, "algo.kl.use_loss": False, "ckpt.best_metric_key": '',
        "ckpt.disable_ds": False, "ckpt.load_enable": False, "ckpt.max_mem": math.inf, "ckpt.max_num": 3,
        "ckpt.output_dir": './ckpt', "ckpt.path": './ckpt/checkpoints_ppo_ray', "ckpt.save_hf": False,
        "ckpt.save_steps": -1, "critic.adam.betas": [0.9, 0.95], "critic.adam.eps": 1e-08, "critic.adam.lr": 9e-06,
        "critic.adam.weight_decay": 0.0, "critic.freezing_steps": -1, "critic.lr_scheduler": 'cosine_with_min_lr',
        "critic.lr_warmup_ratio": 0.03, "critic.max_norm": 1.0, "critic.min_lr_ratio": 0.1,
        "critic.model_name_or_path": None, "critic.muon.lr": 0.02, "critic.muon.momentum": 0.95,
        "critic.muon.nesterov": True, "critic.muon.ns_steps": 5, "critic.num_gpus_per_node": 8,
        "critic.num_nodes": 1, "critic.optim": 'adam', "critic.save_value_network": False, "critic.value_clip": 0.5,
        "data.apply_chat_template": False, "data.dataloader_num_workers": 0, "data.disable_fast_tokenizer": False,
        "data.image_key": 'images', "data.input_key": 'input', "data.input_template": None, "data.label_key": None,
        "data.max_images_per_prompt": 0, "data.max_len": 2048, "data.max_samples": 100000000,
        "data.prompt_dataset": None, "data.prompt_probs": None, "data.prompt_split": 'train',
        "ds.adam_offload": False, "ds.attn_implementation": 'flash_attention_2', "ds.deepcompile": False,
        "ds.enable_sleep": False, "ds.experts_implementation": None, "ds.grad_accum_dtype": None,
        "ds.load_in_4bit": False, "ds.lora.alpha": 16, "ds.lora.dropout": 0, "ds.lora.rank": 0,
        "ds.lora.target_modules": 'all-linear', "ds.overlap_comm": False, "ds.packing_samples": False,
        "ds.param_dtype": 'bf16', "ds.ring_attn_head_stride": 1, "ds.ring_attn_size": 1,
        "ds.tensor_parallel_size": 1, "ds.use_liger_kernel": False, "ds.use_universal_ckpt": False,
        "ds.value_head_prefix": 'score', "ds.zero_stage": 2, "ds.zpg": 1, "eval.dataset": None,
        "eval.n_samples_per_prompt": 4, "eval.split": 'train', "eval.steps": -1, "eval.temperature": 0.6,
        "local_rank": -1, "logger.logging_steps": 1, "logger.tensorboard_dir": None, "logger.wandb.group": None,
        "logger.wandb.key": None, "logger.wandb.org": None, "logger.wandb.project": 'openrlhf_train_ppo',
        "logger.wandb.run_name": 'ppo_(start time)', "ref.num_gpus_per_node": 8, "ref.num_nodes": 1,
        "ref.offload": False, "reward.clip_range": [-10, 10], "reward.model_name_or_path": None,
        "reward.normalize_enable": False, "reward.num_gpus_per_node": 8, "reward.num_nodes": 1,
        "reward.offload": False, "reward.overlong_buffer_len": None, "reward.overlong_penalty_factor": 1,
        "reward.remote_url": None, "reward.stop_properly_penalty_coef": None, "rollout.batch_size": 1024,
        "rollout.max_new_tokens": None, "rollout.max_tokens_per_gpu": None, "rollout.micro_batch_size": 1,
        "rollout.n_samples_per_prompt": 1, "rollout.temperature": 1.0, "rollout.top_p": 1.0,
        "rollout.vllm_generate_batch_size": None, "train.agent_func_path": None, "train.async_enable": False,
        "train.async_queue_size": 1, "train.batch_size": 128, "train.colocate_actor_ref": False,
        "train.colocate_all": False, "train.colocate_critic_reward": False, "train.dynamic_batch_enable": False,
        "train.ema_beta": 0.992, "train.enable_ema": False, "train.full_determinism_enable": False,
        "train.max_epochs": 1, "train.max_tokens_per_gpu": 16192, "train.micro_batch_size": 1,
        "train.num_episodes": 1, "train.partial_rollout_enable": False, "train.seed": 42, "use_ms": False,
        "vllm.enable_prefix_caching": False, "vllm.enable_sleep": False, "vllm.enforce_eager": False,
        "vllm.gpu_memory_utilization": 0.95, "vllm.num_engines": None, "vllm.sync_backend": 'nccl',
        "vllm.sync_with_ray": False, "vllm.tensor_parallel_size": 1,
    },
    "serve_rm": {
        "batch_size": None, "data.disable_fast_tokenizer": False, "data.max_len": 2048,
        "ds.attn_implementation": 'flash_attention_2', "ds.experts_implementation": None, "ds.load_in_4bit": False,
        "ds.packing_samples": False, "ds.param_dtype": 'bf16', "ds.value_head_prefix": 'score', "host": '0.0.0.0',
        "port": 5000, "reward.model_name_or_path": None, "reward.normalize_enable": False, "use_ms": False,
    },
}


@dataclass(frozen=True)
class Difference:
    """OpenRLHF's `flag` has another default in rlhfkit's `commands`, for the reason `why` (one line).

    `ours` / `their` say how the table and the start-up line show a default that is not one value (default: the
    value); `applies(cfg)` says whether a run relies on the flag at all (default: always)."""

    commands: tuple[str, ...]
    flag: str
    why: str
    ours: str = ""
    their: str = ""
    applies: Callable[[Any], bool] | None = None


def _writes_checkpoints(cfg: Any) -> bool:
    return cfg.checkpoint.save_steps > 0 or cfg.checkpoint.load_checkpoint


def _uses_wandb(cfg: Any) -> bool:
    return bool(cfg.logging.use_wandb)


def _role_needed(role: str) -> Callable[[Any], bool]:
    def applies(cfg: Any) -> bool:
        from rlhfkit.config.rl import role_needed

        return role_needed(cfg, role)
    return applies


_TRAINERS = ("train_sft", "train_rm", "train_dpo", "train_ppo_ray")
_ALL = (*_TRAINERS, "serve_rm")
_PPO = ("train_ppo_ray",)

DIFFERENCES: tuple[Difference, ...] = (
    Difference(_ALL, "ds.param_dtype", "bf16 needs a GPU: auto is OpenRLHF's bf16 on a CUDA GPU and fp32 on a CPU",
               ours="auto: bf16 on a CUDA GPU, else fp32"),
    Difference(_ALL, "ds.attn_implementation", "flash_attention_2 needs a CUDA GPU and the flash-attn package: auto "
               "picks it where both are, sdpa elsewhere", ours="auto: flash_attention_2 on a CUDA GPU with "
               "flash-attn, else sdpa"),
    Difference(_TRAINERS, "ckpt.path", "one folder for every trainer is safe: a run stops on another run's "
               "checkpoints there unless --load_checkpoint or --overwrite_ckpt says what to do",
               applies=_writes_checkpoints),
    Difference(_TRAINERS, "logger.wandb.project", "rlhfkit runs go to an rlhfkit project, not among OpenRLHF's "
               "runs", applies=_uses_wandb),
    *(Difference(_PPO, f"{role}.num_gpus_per_node", "8 fails at once on a CPU or one-GPU machine; 1 runs "
                 "anywhere, and a multi-GPU command gives its count", applies=_role_needed(role))
      for role in ("actor", "critic", "ref", "reward")),
    Difference(_PPO, "rollout.max_new_tokens", "a fixed response budget, which the memory plan, "
               "--overlong_buffer_len and length-normalised losses need; with --prompt_max_len 1024 it keeps "
               "OpenRLHF's 2048-token total", their="None: --data.max_len minus each prompt"),
    Difference(_PPO, "train.max_tokens_per_gpu", "the budget depends on the model and the device, so "
               "--use_dynamic_batch asks for it (one line, exit 2) instead of assuming one",
               applies=lambda cfg: cfg.strategy.use_dynamic_batch),
    Difference(_PPO, "data.max_images_per_prompt", "--image_key turns images on by itself, so one image per record "
               "is allowed unless told; 0 would refuse every record that has one",
               applies=lambda cfg: bool(cfg.vision.image_key)),
    Difference(("serve_rm",), "host", "serve this machine only unless told: 0.0.0.0 exposes the model to the "
               "network"),
    Difference(("serve_rm",), "batch_size", "bounds the memory of one forward pass; OpenRLHF scores a whole request "
               "in one", their="None: a whole request"),
    Difference(("serve_rm",), "reward.normalize_enable", "the reward model's saved --normalize_reward mark decides, "
               "so a model trained normalised serves normalised rewards without a second flag",
               ours="None: as the saved model says"),
)

# Their value spelled another way for the same behaviour: listed in the docs table, no start-up line.
SAME_MEANING: tuple[Difference, ...] = (
    Difference(_TRAINERS, "logger.wandb.run_name", "both name a run after its trainer and start time",
               ours="None: the trainer's name and the start time"),
    Difference(_PPO, "vllm.num_engines", "None and 0 both mean no vLLM engine (rlhfkit then generates with "
               "Transformers)"),
    Difference(_PPO, "actor.entropy_coef", "None and 0 both add no entropy term to the loss (rlhfkit logs the "
               "entropy either way)"),
    Difference(_PPO, "ckpt.best_metric_key", "'' and None both mean no best-model export"),
    Difference(_PPO, "data.image_key", "both defaults train on text only: OpenRLHF reads no image with its default "
               "of 0 images per prompt, rlhfkit reads images only with --image_key", ours="None: no images"),
    Difference(_PPO, "ckpt.max_mem", "1e8 GB (100 PB) is no limit in practice either"),
    *(Difference(_PPO, f"critic.{flag}", "the critic takes the actor's setting unless given its own, and the "
                 "actor's default is OpenRLHF's critic default", ours="None: the actor's")
      for flag in ("optim", "adam.betas", "adam.eps", "adam.weight_decay", "lr_scheduler", "lr_warmup_ratio",
                   "min_lr_ratio", "max_norm", "muon.lr", "muon.momentum", "muon.ns_steps", "muon.nesterov")),
)


def openrlhf_command(command: str) -> str | None:
    """The OpenRLHF 0.11 command whose defaults rlhfkit's `command` follows, or None (train_kto, the tools)."""
    command = SAME_DEFAULTS_AS.get(command, command)
    return command if command in COMMANDS else None


def config_class(command: str) -> type:
    module, _, name = COMMANDS[command].partition(":")
    return getattr(importlib.import_module(module), name)


def field_for(flag: str, cls: type) -> str | None:
    """Our field that OpenRLHF's `flag` sets with the same value: the field itself, a field alias, or an entry of
    `openrlhf_names.ALIASES`; None for a flag of another value shape (ADAPTED) or none at all."""
    fields = field_names(cls)
    if flag in fields:
        return flag
    for _, name, f, _ in iter_fields(cls):
        if flag in f.metadata.get("aliases", ()):
            return name
    return theirs.alias_target(flag, fields)


def our_values(flag: str, value: Any, cls: type, current: Callable[[str], Any]) -> dict[str, Any] | None:
    """The field values of `cls` that OpenRLHF's `flag` at `value` means (`current(name)` reads the others, for a
    relative flag); None when rlhfkit does not implement the flag (NOT_SUPPORTED)."""
    name = field_for(flag, cls)
    if name is not None:
        return {name: value}
    adapted = theirs.adapted_for(flag, field_names(cls))
    if adapted is None:
        return None
    if value is None:
        return {}  # an adapted flag's None default is "not given" (--actor.eps_clip_low_high: --actor.eps_clip)
    if adapted.nargs not in (None, "?") and not isinstance(value, list):
        value = [value]
    return adapted.convert(value, current)


def same_value(a: Any, b: Any) -> bool:
    """Equal as flag values: 1e8 == 100000000, [0.9, 0.95] == (0.9, 0.95), inf == inf."""
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    numbers = (int, float)
    if isinstance(a, numbers) and isinstance(b, numbers) and not isinstance(a, bool) and not isinstance(b, bool):
        return float(a) == float(b) or (math.isinf(a) and math.isinf(b) and (a > 0) == (b > 0))
    return a == b


def differing_defaults(command: str, values: dict[str, Any] | None = None) -> dict[str, tuple[dict[str, Any], Any]]:
    """{their flag: ({our field: our value}, their default)} for every flag of OpenRLHF's `command` whose default
    means something else than ours (`values`: our field values, default the config class's defaults)."""
    cls = config_class(command)
    ours = field_defaults(cls) if values is None else values
    found = {}
    for flag, default in OPENRLHF[command].items():
        try:
            wanted = our_values(flag, default, cls, ours.get)
        except UserError:
            continue  # their default cannot stand beside this run's other values (--data.max_len 2048 under
            # --generate_max_len 4096): the run could not take it, so there is no difference it relies on
        if wanted is None:
            continue  # not implemented: giving it fails, and leaving it out is the only behaviour rlhfkit has
        mine = {name: ours[name] for name in wanted}
        if not all(same_value(mine[name], value) for name, value in wanted.items()):
            found[flag] = (mine, default)
    return found


def _show(value: Any, field: str) -> str:
    if field == "bf16" and isinstance(value, bool):
        return "bf16" if value else "fp32"
    if isinstance(value, (list, tuple)):
        return " ".join(map(str, value))
    return "''" if value == "" else str(value)


def startup_notes(command: str, cfg: Any, given: frozenset[str] | set[str]) -> list[str]:
    """One line per listed difference that this run relies on: the flag was not given (in any spelling or in the
    config file), the run uses it (`applies`), and the value it runs with is not OpenRLHF's (an "auto" that
    resolved to theirs gives no line)."""
    openrlhf = openrlhf_command(command)
    if openrlhf is None:
        return []
    differing = differing_defaults(openrlhf, field_values(cfg))
    lines = []
    for d in DIFFERENCES:
        if openrlhf not in d.commands or d.flag not in differing:
            continue
        mine, default = differing[d.flag]
        if set(mine) & set(given) or (d.applies is not None and not d.applies(cfg)):
            continue
        name, value = next(iter(mine.items()))
        shown = d.ours if value is None and d.ours else _show(value, name)
        spelling = f"--{name}" + ("" if name == d.flag else f" (--{d.flag})")
        lines.append(f"rlhfkit: {spelling} not given: {shown} here, OpenRLHF uses "
                     f"{d.their or _show(default, name)} ({ANCHOR})")
    return lines


def defaults_table() -> str:
    """docs/migration.md#defaults: every default rlhfkit keeps, and the ones spelled another way, with why."""
    rows = ["| OpenRLHF 0.11 flag | commands | rlhfkit | OpenRLHF | why |", "| --- | --- | --- | --- | --- |"]
    for d in (*DIFFERENCES, *SAME_MEANING):
        cls = config_class(d.commands[0])
        name = field_for(d.flag, cls) or next(iter(our_values(d.flag, OPENRLHF[d.commands[0]][d.flag], cls,
                                                              field_defaults(cls).get) or {d.flag: None}))
        mine = {_show(field_defaults(config_class(c))[name], name) for c in d.commands}
        their = {c: _show(OPENRLHF[c][d.flag], name) for c in d.commands}
        their_text = d.their or (next(iter(their.values())) if len(set(their.values())) == 1 else
                                 "; ".join(f"{v} ({c})" for c, v in their.items()))
        same = "Same behaviour: " if d in SAME_MEANING else ""
        rows.append(f"| `--{d.flag}` | {', '.join(d.commands)} | `--{name}` {d.ours or ', '.join(sorted(mine))} | "
                    f"{their_text} | {same}{d.why} |")
    return "\n".join(rows)
