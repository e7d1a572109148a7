"""OpenRLHF's other spellings of our flags: the dotted flags of OpenRLHF 0.10.2+ and the flat flags it renamed.

rlhfkit's flags are OpenRLHF's flat flags (`--pretrain`, `--zero_stage`, ...). OpenRLHF 0.10.2 moved every flag
under a dotted section (`--actor.model_name_or_path`, `--ds.zero_stage`, `--train.colocate_all`, ...) and renamed
a few flat ones before that (`--eps_clip_low_high LO HI`, `--param_dtype bf16`). This module is the one table of
those spellings; `rlhfkit.config.base` turns it into parser aliases, `--config` file keys, the docs site's flag
tables and docs/migration.md, so a command pasted from either OpenRLHF generation parses.

Three kinds of entries:
- ALIASES: their flag -> our field(s) with the same value. A tuple of candidates means "the first field that the
  command's config has" (DPO's `--ref.offload` is `--ref_offload`; train_ppo_ray's is `--ref_reward_offload`).
- ADAPTED: their flag whose value has another shape; a function turns it into our fields
  (`--eps_clip_low_high 0.2 0.28` -> `--clip_eps_low 0.2 --clip_eps_high 0.28`).
- NOT_SUPPORTED: their flags with no rlhfkit equivalent yet, with the reason. They parse only to fail with one
  line, "--x.y is not supported yet by rlhfkit (reason)", exit code 2: never "unrecognized arguments", never
  accepted and ignored.
An alias whose field the command does not have (e.g. `--data.prompt_dataset` on train_sft) is reported like a
NOT_SUPPORTED flag, naming the command.

OpenRLHF's FSDP2 branch (its PR 1176, in no release up to 0.11.0) has flags of its own (`--fsdp2_enable_sleep`,
...): `rlhfkit.config.openrlhf_fsdp2` lists them, and ADAPTED and NOT_SUPPORTED take them in.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rlhfkit.config import openrlhf_fsdp2 as fsdp2_branch
from rlhfkit.errors import UserError

# -- same value, another name --------------------------------------------------------------------------------
ALIASES: dict[str, str | tuple[str, ...]] = {
    # models
    "actor.model_name_or_path": "pretrain",
    "model.model_name_or_path": "pretrain",
    "reward.model_name_or_path": "reward_pretrain",
    "critic.model_name_or_path": "critic_pretrain",
    "ref.model_name_or_path": "ref_pretrain",
    "reward.remote_url": "remote_rm_url",
    "ds.value_head_prefix": "value_head_prefix",
    "ds.attn_implementation": "attn_implementation",
    "actor.gradient_checkpointing_enable": "gradient_checkpointing",
    "model.gradient_checkpointing_enable": "gradient_checkpointing",
    "actor.gradient_checkpointing_reentrant": "gradient_checkpointing_use_reentrant",
    "model.gradient_checkpointing_reentrant": "gradient_checkpointing_use_reentrant",
    "data.disable_fast_tokenizer": "disable_fast_tokenizer",
    "ds.load_in_4bit": "load_in_4bit",
    "ds.lora.rank": "lora_rank",
    "ds.lora.alpha": "lora_alpha",
    "ds.lora.dropout": "lora_dropout",
    "ref.offload": ("ref_offload", "ref_reward_offload"),
    "reward.offload": "ref_reward_offload",
    # asynchronous training (OpenRLHF 0.10.2+ docs: --train.async_enable, --train.async_queue_size,
    # --train.partial_rollout_enable, --rollout.vllm_generate_batch_size)
    "train.async_enable": "async_train",
    "train.async_queue_size": "async_queue_size",
    "train.partial_rollout_enable": "partial_rollout",
    "rollout.vllm_generate_batch_size": "vllm_generate_batch_size",
    # features that landed after the first alias table (names from OpenRLHF 0.10.2+ and its 0.9 flat CLI)
    "train.agent_func_path": "agent_func_path",
    "train.dynamic_batch_enable": "use_dynamic_batch",
    "train.max_tokens_per_gpu": "max_tokens_per_gpu",
    "train_max_tokens_per_gpu": "max_tokens_per_gpu",
    "rollout.max_tokens_per_gpu": "rollout_max_tokens_per_gpu",
    "train.enable_ema": "enable_ema",
    "train.ema_beta": "ema_beta",
    "ckpt.best_metric_key": "best_metric_key",
    "algo.dynamic_filtering_enable": "dynamic_filtering",
    "algo.dynamic_filtering_range": "dynamic_filtering_reward_range",
    "reward.overlong_buffer_len": "overlong_buffer_len",
    "reward.overlong_penalty_factor": "overlong_penalty_factor",
    "reward.stop_properly_penalty_coef": "stop_properly_penalty_coef",
    "algo.advantage.is_correction_type": "vllm_is_correction_type",
    # vision-language models (train_sft, train_rm, train_dpo, train_kto, train_ppo, train_ppo_ray; the other
    # commands refuse them with ONLY_SOME)
    "data.image_key": "image_key",
    "data.max_images_per_prompt": "max_images_per_prompt",
    "actor.freeze_visual_encoder": "freeze_visual_encoder",
    "algo.advantage.is_correction_threshold": "vllm_is_truncated_threshold",
    "actor.policy_loss_type": "policy_loss_type",
    # DeepSpeed and optimizer
    "ds.zero_stage": "zero_stage",
    "ds.adam_offload": "adam_offload",
    "ds.zpg": "zpg",
    "ds.tensor_parallel_size": "ds_tensor_parallel_size",
    "ds.overlap_comm": "overlap_comm",
    "ds.grad_accum_dtype": "grad_accum_dtype",
    "ds.enable_sleep": "deepspeed_enable_sleep",
    "ds.packing_samples": "packing_samples",
    "ds.ring_attn_size": "ring_attn_size",
    "ds.ring_attn_head_stride": "ring_head_stride",
    "ds.use_universal_ckpt": "use_ds_universal_ckpt",
    "train.batch_size": "train_batch_size",
    "train.micro_batch_size": "micro_train_batch_size",
    "train.seed": "seed",
    "train.full_determinism_enable": "full_determinism",
    "ds.use_liger_kernel": "use_liger_kernel",
    "ds.deepcompile": "deepcompile",
    "train.max_epochs": "max_epochs",
    "train.num_episodes": "num_episodes",
    "adam.lr": "learning_rate",
    "actor.adam.lr": "actor_learning_rate",
    "critic.adam.lr": "critic_learning_rate",
    "adam.betas": "adam_betas",
    "actor.adam.betas": "adam_betas",
    "adam.weight_decay": "l2",
    "actor.adam.weight_decay": "l2",
    "actor.lr_scheduler": "lr_scheduler",
    "actor.lr_warmup_ratio": "lr_warmup_ratio",
    "actor.max_norm": "max_norm",
    "adam.eps": "adam_eps",
    "actor.adam.eps": "adam_eps",
    "actor.min_lr_ratio": "min_lr_ratio",
    "actor.optim": "optim",
    "muon.lr": "muon_lr",
    "muon.momentum": "muon_momentum",
    "muon.ns_steps": "muon_ns_steps",
    "actor.muon.lr": "muon_lr",
    "actor.muon.momentum": "muon_momentum",
    "actor.muon.ns_steps": "muon_ns_steps",
    # the critic's own optimizer settings (None: the actor's)
    "critic.optim": "critic_optim",
    "critic.adam.betas": "critic_adam_betas",
    "critic.adam.eps": "critic_adam_eps",
    "critic.adam.weight_decay": "critic_l2",
    "critic.lr_scheduler": "critic_lr_scheduler",
    "critic.lr_warmup_ratio": "critic_lr_warmup_ratio",
    "critic.min_lr_ratio": "critic_min_lr_ratio",
    "critic.max_norm": "critic_max_norm",
    "critic.muon.lr": "critic_muon_lr",
    "critic.muon.momentum": "critic_muon_momentum",
    "critic.muon.ns_steps": "critic_muon_ns_steps",
    # data
    "data.dataset": "dataset",
    "data.dataset_probs": "dataset_probs",
    "data.dataset_split": "dataset_split",
    "data.prompt_dataset": "prompt_data",
    "data.prompt_probs": "prompt_data_probs",
    "data.prompt_split": "prompt_split",
    "data.max_samples": "max_samples",
    "data.max_len": "max_len",
    "data.input_key": "input_key",
    "data.output_key": "output_key",
    "data.label_key": "label_key",
    "data.prompt_key": "prompt_key",
    "data.chosen_key": "chosen_key",
    "data.rejected_key": "rejected_key",
    "data.input_template": "input_template",
    "data.apply_chat_template": "apply_chat_template",
    "data.tokenizer_chat_template": "tokenizer_chat_template",
    "data.multiturn": "multiturn",
    "model.pretrain_mode_enable": "pretrain_mode",
    "eval.dataset": "eval_dataset",
    "eval.split": "eval_split",
    "eval.steps": "eval_steps",
    "eval.temperature": "eval_temperature",
    "eval.n_samples_per_prompt": "eval_n_samples_per_prompt",
    # losses of the offline trainers
    "model.aux_loss_coef": "aux_loss_coef",
    "actor.aux_loss_coef": "aux_loss_coef",
    "model.beta": "beta",
    "model.ipo_enable": "ipo",
    "model.label_smoothing": "label_smoothing",
    "model.nll_loss_coef": "nll_loss_coef",
    "model.loss_type": "loss",
    "model.compute_fp32_loss_enable": "compute_fp32_loss",
    # RL placement and engines
    "actor.num_nodes": "actor_num_nodes",
    "actor.num_gpus_per_node": "actor_num_gpus_per_node",
    "critic.num_nodes": "critic_num_nodes",
    "critic.num_gpus_per_node": "critic_num_gpus_per_node",
    "ref.num_nodes": "ref_num_nodes",
    "ref.num_gpus_per_node": "ref_num_gpus_per_node",
    "reward.num_nodes": "reward_num_nodes",
    "reward.num_gpus_per_node": "reward_num_gpus_per_node",
    "train.colocate_actor_ref": "colocate_actor_ref",
    "train.colocate_critic_reward": "colocate_critic_reward",
    "train.colocate_all": "colocate_all_models",
    "vllm.num_engines": "vllm_num_engines",
    "vllm.tensor_parallel_size": "vllm_tensor_parallel_size",
    "vllm.gpu_memory_utilization": "vllm_gpu_memory_utilization",
    "vllm.sync_backend": "vllm_sync_backend",
    "vllm.enable_sleep": "vllm_enable_sleep",
    "vllm.enforce_eager": "enforce_eager",
    "vllm.enable_prefix_caching": "enable_prefix_caching",
    # RL rollout and algorithm
    "rollout.batch_size": "rollout_batch_size",
    "rollout.micro_batch_size": "micro_rollout_batch_size",
    "rollout.n_samples_per_prompt": "n_samples_per_prompt",
    "rollout.max_new_tokens": "generate_max_len",
    "rollout.temperature": "temperature",
    "rollout.top_p": "top_p",
    "algo.advantage.estimator": "advantage_estimator",
    "algo.advantage.gamma": "gamma",
    "algo.advantage.lambd": "lambd",
    "algo.advantage.no_std_norm": "no_advantage_std_norm",
    "algo.advantage.is_correction_enable": "enable_vllm_is_correction",
    "algo.kl.use_loss": "use_kl_loss",
    "algo.kl.estimator": "kl_estimator",
    "algo.kl.init_coef": "init_kl_coef",
    "algo.kl.target": "kl_target",
    "algo.kl.horizon": "kl_horizon",
    "actor.eps_clip": "eps_clip",
    "actor.dual_clip": "dual_clip",
    "actor.entropy_coef": "entropy_loss_coef",
    "critic.value_clip": "value_clip",
    "critic.freezing_steps": "freezing_actor_steps",
    "critic.save_value_network": "save_value_network",
    "reward.normalize_enable": "normalize_reward",
    "reward.clip_range": "reward_clip_range",
    # checkpoints and logging
    "ckpt.output_dir": "save_path",
    "ckpt.path": "ckpt_path",
    "ckpt.save_steps": "save_steps",
    "ckpt.save_hf": "save_hf_ckpt",
    "ckpt.max_num": "max_ckpt_num",
    "ckpt.max_mem": "max_ckpt_mem",
    "ckpt.load_enable": "load_checkpoint",
    "logger.logging_steps": "logging_steps",
    "logger.wandb.key": "use_wandb",
    "logger.wandb.org": "wandb_org",
    "logger.wandb.group": "wandb_group",
    "logger.wandb.project": "wandb_project",
    "logger.wandb.run_name": "wandb_run_name",
    "logger.tensorboard_dir": "use_tensorboard",
}


# -- another shape ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Adapted:
    """Their flag `flag` takes `nargs` values of `kind`; `convert(value, current)` returns our field values.

    `current(name)` reads a field's value as set so far (explicit or default), for a flag defined relative to
    another one (OpenRLHF's `--data.max_len` is prompt plus response; ours is split in two). `fields` are the
    fields it writes; it applies to a config that has all of `needs` (default: `fields`). A flag that only
    checks its value writes nothing and needs the field it concerns."""

    flag: str
    fields: tuple[str, ...]
    convert: Callable[[Any, Callable[[str], Any]], dict[str, Any]]
    kind: type = str
    nargs: int | str | None = None
    metavar: str | tuple[str, ...] | None = None
    help: str = ""
    needs: tuple[str, ...] = ()

    def applies(self, fields: set[str] | frozenset[str]) -> bool:
        return all(f in fields for f in (self.needs or self.fields))


def _clip_low_high(value: list[float], current: Callable[[str], Any]) -> dict[str, Any]:
    low, high = value
    return {"clip_eps_low": float(low), "clip_eps_high": float(high)}


def _param_dtype(flag: str) -> Callable[[str, Callable[[str], Any]], dict[str, Any]]:
    def convert(value: str, current: Callable[[str], Any]) -> dict[str, Any]:
        if value in ("bf16", "fp32"):  # fp32 is rlhfkit's: it keeps fp32 where bf16 is the default (a GPU)
            return {"bf16": value == "bf16"}
        raise UserError(f"--{flag} {value} is not supported yet by rlhfkit (it trains in bf16 or fp32: "
                        f"--{flag} bf16 / --bf16, or --{flag} fp32)")
    return convert


def _total_len(value: int, current: Callable[[str], Any]) -> dict[str, Any]:
    """OpenRLHF's RL `--data.max_len` bounds prompt + response; ours bounds each: prompt = total - response."""
    generate = current("generate_max_len")
    prompt = int(value) - int(generate)
    if prompt <= 0:
        raise UserError(f"--data.max_len {value} (prompt + response) leaves no room for the prompt with "
                        f"--generate_max_len / --rollout.max_new_tokens {generate}; raise --data.max_len or lower "
                        "--rollout.max_new_tokens")
    return {"prompt_max_len": prompt}


def _target_modules(value: list[str], current: Callable[[str], Any]) -> dict[str, Any]:
    # OpenRLHF's default "all-linear" is rlhfkit's default (no list): every linear layer.
    return {"target_modules": None if value in ([], ["all-linear"]) else list(value)}


def _switch(field: str, on: bool) -> Callable[[Any, Callable[[str], Any]], dict[str, Any]]:
    """OpenRLHF's pair of store_true / store_false flags of one setting (`--muon.nesterov`, `--muon.no_nesterov`):
    given bare on the command line the flag means `on`; a config file's `true` / `false` says whether it is set."""
    def convert(value: Any, current: Callable[[str], Any]) -> dict[str, Any]:
        if value not in (None, True, False):
            raise UserError(f"--{field} takes no value (got {value})")
        return {field: on if value in (None, True) else not on}
    return convert


def _nesterov(prefix: str, field: str) -> tuple[Adapted, Adapted]:
    return (Adapted(f"{prefix}muon.nesterov", (field,), _switch(field, True), str, "?", "",
                    f"OpenRLHF 0.11: Nesterov momentum in Muon (--{field}, the default)."),
            Adapted(f"{prefix}muon.no_nesterov", (field,), _switch(field, False), str, "?", "",
                    f"OpenRLHF 0.11: plain momentum in Muon (--{field} off)."))


ADAPTED: tuple[Adapted, ...] = (
    Adapted("eps_clip_low_high", ("clip_eps_low", "clip_eps_high"), _clip_low_high, float, 2, ("LO", "HI"),
            "OpenRLHF's spelling of --clip_eps_low LO --clip_eps_high HI."),
    Adapted("actor.eps_clip_low_high", ("clip_eps_low", "clip_eps_high"), _clip_low_high, float, 2, ("LO", "HI"),
            "OpenRLHF 0.10.2+: --clip_eps_low LO --clip_eps_high HI."),
    Adapted("param_dtype", ("bf16",), _param_dtype("param_dtype"), str, None, "{bf16,fp32}",
            "OpenRLHF's spelling of --bf16 (bf16); fp32 keeps fp32 on a GPU, where bf16 is the default."),
    Adapted("ds.param_dtype", ("bf16",), _param_dtype("ds.param_dtype"), str, None, "{bf16,fp32}",
            "OpenRLHF 0.10.2+: --bf16 (bf16); fp32 keeps fp32 on a GPU, where bf16 is the default."),
    Adapted("data.max_len", ("prompt_max_len",), _total_len, int, None, "N",
            "OpenRLHF 0.10.2+ RL: prompt + response tokens; sets --prompt_max_len N - --generate_max_len."),
    Adapted("ds.lora.target_modules", ("target_modules",), _target_modules, str, "*", "NAME",
            "OpenRLHF 0.10.2+: --target_modules ('all-linear': every linear layer, the default)."),
    *_nesterov("", "muon_nesterov"),
    *_nesterov("actor.", "muon_nesterov"),
    *_nesterov("critic.", "critic_muon_nesterov"),
    *(Adapted(*spec) for spec in fsdp2_branch.ADAPTED),
)

# -- no equivalent yet --------------------------------------------------------------------------------------
_VLM = ("images train with train_sft, train_rm, train_dpo, train_kto, train_ppo and train_ppo_ray and generate "
        "with batch_inference; this command does not take images")

NOT_SUPPORTED: dict[str, str] = {
    # flat (OpenRLHF 0.8/0.9) flags
    "disable_ds_ckpt": "checkpoints always hold the DeepSpeed states needed to resume",
    "use_ms": "ModelScope downloads are not supported; pass a local model directory",
    # dotted (OpenRLHF 0.10.2+) flags
    "ds.experts_implementation": "MoE expert kernels are chosen by Transformers",
    "vllm.sync_with_ray": "weights reach the engines over --vllm_sync_backend or the Ray object store as chosen "
                          "by rlhfkit",
    "data.dataloader_num_workers": "data is tokenised up front in the main process; there is no loader to "
                                   "parallelise",
    "dataloader_num_workers": "data is tokenised up front in the main process; there is no loader to parallelise",
    "ckpt.disable_ds": "checkpoints always hold the DeepSpeed states needed to resume",
    "model.margin_loss_enable": "train_rm reads a per-pair margin from the record key named by --margin_key",
    **fsdp2_branch.NOT_SUPPORTED,
}

# Their flags that only some commands take: the reason the others give.
ONLY_SOME: dict[str, str] = {
    "data.image_key": _VLM,
    "data.max_images_per_prompt": _VLM,
    "actor.freeze_visual_encoder": _VLM,
}

# Our flags that OpenRLHF's flat CLI never had (the migration table shows no flat OpenRLHF spelling for them).
RLHFKIT_ONLY = frozenset({
    "remote_rm_timeout", "remote_rm_retries", "metrics_path", "disable_progress_bar", "clip_eps_low",
    "clip_eps_high", "reward_stats_samples", "policy_loss_agg", "host", "port", "api_key", "batch_size",
    "batch_wait_ms", "max_body_bytes", "compute_fp32_loss", "ddp_timeout", "dry_run", "dry_run_gpu_memory_gb",
    "dry_run_num_gpus", "partial_rollout_chunk_len", "doctor", "doctor_window", "doctor_entropy_ratio",
    "doctor_kl_max", "doctor_clip_fraction_range", "doctor_length_range", "doctor_truncated_max",
    "doctor_equal_reward_groups_max",
    "doctor_logprob_gap_max", "doctor_heldout_drop", "tau_pos", "tau_neg", "loss_type", "simpo_gamma", "backend",
    "teacher_pretrain", "teacher_url", "teacher_timeout", "distill_loss", "distill_topk", "distill_coef",
    "distill_only", "teacher_num_nodes", "teacher_num_gpus_per_node", "teacher_api_key",
    "lora_sync",
})


def alias_target(flag: str, fields: set[str] | frozenset[str]) -> str | None:
    """Our field that OpenRLHF's `flag` sets in a config with `fields`, or None when it has no plain alias there."""
    target = ALIASES.get(flag)
    if target is None:
        return None
    for name in (target,) if isinstance(target, str) else target:
        if name in fields:
            return name
    return None


def adapted_for(flag: str, fields: set[str] | frozenset[str]) -> Adapted | None:
    """The value adapter of `flag` for a config with `fields` (every field it writes must exist there)."""
    for a in ADAPTED:
        if a.flag == flag and a.applies(fields):
            return a
    return None


def not_supported_reason(flag: str, fields: set[str] | frozenset[str]) -> str | None:
    """Why `flag` (OpenRLHF's) does not work with this config, or None when it is not one of theirs."""
    if flag in fields:
        return None
    if flag in NOT_SUPPORTED:
        return NOT_SUPPORTED[flag]
    known = flag in ALIASES or any(a.flag == flag for a in ADAPTED)
    if known and alias_target(flag, fields) is None and adapted_for(flag, fields) is None:
        return ONLY_SOME.get(flag, "this command has no equivalent option")
    return None


def openrlhf_flags_of(field: str, fields: set[str] | frozenset[str]) -> list[str]:
    """Every OpenRLHF spelling (dotted or renamed flat) that sets `field` in a config with `fields`."""
    names = [flag for flag in ALIASES if alias_target(flag, fields) == field]
    names += [a.flag for a in ADAPTED if field in a.fields and adapted_for(a.flag, fields) is a]
    return names
