"""`rl_specs(cfg)`: the specs of an RL run's roles, engines and placement (`rlhfkit.config.specs`), derived once
from a validated `PPOConfig`. The runners call it once and hand each part its spec."""

from __future__ import annotations

import dataclasses
from typing import Any

from rlhfkit.config.critic_optim import critic_strategy
from rlhfkit.config.lora_sync import lora_sync_mode
from rlhfkit.config.rl import (
    ROLES,
    PPOConfig,
    clip_range,
    critic_needs_head,
    critic_path,
    engine_backend,
    is_bounds,
    loss_aggregation,
    needs_critic,
    needs_reference,
    role_needed,
    role_ranks,
    samples_per_rollout,
)
from rlhfkit.config.specs import (
    ActorSpec,
    BatchSpec,
    CriticSpec,
    EngineSpec,
    PlacementSpec,
    ReferenceSpec,
    RewardSpec,
    RLSpecs,
    TeacherSpec,
)

#: The least rows a Transformers engine generates per forward in an RL run (more with --micro_rollout_batch_size).
HF_ENGINE_MIN_BATCH = 256


def batch_spec(cfg: PPOConfig) -> BatchSpec:
    s = cfg.strategy
    return BatchSpec(train_batch_size=s.train_batch_size, micro_train_batch_size=s.micro_train_batch_size,
                     micro_rollout_batch_size=cfg.rollout.micro_rollout_batch_size,
                     max_tokens_per_gpu=s.max_tokens_per_gpu if s.use_dynamic_batch else None,
                     scoring_max_tokens_per_gpu=cfg.rollout.rollout_max_tokens_per_gpu,
                     packed=cfg.data.packing_samples, max_epochs=cfg.rollout.max_epochs)


def _role_common(cfg: PPOConfig) -> dict[str, Any]:
    """The RoleSpec fields, with copies of the shared sections (a spec never aliases the mutable config)."""
    return {"model": dataclasses.replace(cfg.model), "strategy": dataclasses.replace(cfg.strategy),
            "batch": batch_spec(cfg), "universal_ckpt": cfg.checkpoint.use_ds_universal_ckpt}


def actor_spec(cfg: PPOConfig) -> ActorSpec:
    a = cfg.algo
    low, high = clip_range(cfg)
    agg = loss_aggregation(cfg)
    is_low, is_high = is_bounds(cfg) if a.enable_vllm_is_correction else (0.0, 0.0)
    return ActorSpec(**_role_common(cfg), learning_rate=a.actor_learning_rate, temperature=cfg.rollout.temperature,
                     clip_low=low, clip_high=high, dual_clip=a.dual_clip, loss_agg=agg,
                     loss_norm_len=cfg.data.generate_max_len if agg == "seq_mean_token_sum_norm" else None,
                     policy_loss_type=a.policy_loss_type, tau_pos=a.tau_pos, tau_neg=a.tau_neg,
                     is_correction=a.enable_vllm_is_correction,
                     is_correction_type=a.vllm_is_correction_type, is_low=is_low, is_high=is_high,
                     kl_estimator=a.kl_estimator, use_kl_loss=a.use_kl_loss, entropy_loss_coef=a.entropy_loss_coef,
                     aux_loss_coef=a.aux_loss_coef, ema_beta=cfg.save.ema_beta if cfg.save.enable_ema else None,
                     save_hf_ckpt=cfg.save.save_hf_ckpt, freeze_visual_encoder=cfg.vision.freeze_visual_encoder,
                     **distill_settings(cfg))


def distill_settings(cfg: PPOConfig) -> dict[str, Any]:
    """The actor's on-policy distillation fields (none without a teacher)."""
    d = cfg.distill
    return {"distill_loss": d.distill_loss, "distill_coef": d.distill_coef,
            "distill_only": d.distill_only} if d.enabled else {}


def teacher_topk(cfg: PPOConfig) -> int:
    """How many of the teacher's top tokens per position the loss needs (0: the sampled token's log-prob only)."""
    return cfg.distill.distill_topk if cfg.distill.distill_loss == "topk_forward_kl" else 0


def teacher_spec(cfg: PPOConfig) -> TeacherSpec:
    return TeacherSpec(**_role_common(cfg), path=cfg.distill.teacher_pretrain, temperature=cfg.rollout.temperature,
                       topk=teacher_topk(cfg))


def critic_spec(cfg: PPOConfig) -> CriticSpec:
    """The critic's strategy carries its own optimizer settings (`--critic.optim`, `--critic.adam.*`, ...)."""
    common = {**_role_common(cfg), "strategy": critic_strategy(cfg.strategy, cfg.critic_optim)}
    return CriticSpec(**common, path=critic_path(cfg), value_head_prefix=cfg.rl_model.value_head_prefix,
                      require_head=critic_needs_head(cfg), learning_rate=cfg.algo.critic_learning_rate,
                      value_clip=cfg.algo.value_clip)


def reference_spec(cfg: PPOConfig) -> ReferenceSpec:
    return ReferenceSpec(**_role_common(cfg), path=cfg.model.pretrain, temperature=cfg.rollout.temperature)


def reward_spec(cfg: PPOConfig) -> RewardSpec:
    return RewardSpec(**_role_common(cfg), path=cfg.rl_model.reward_pretrain,
                      value_head_prefix=cfg.rl_model.value_head_prefix, normalize=cfg.algo.normalize_reward)


def generate_batch(cfg: PPOConfig) -> int:
    """The most sequences one generate call hands the engines (it sizes vLLM's CPU KV cache): a rollout batch; 0
    (unknown: as many as vLLM runs at once) with --eval_dataset, whose prompts x eval samples go in one call."""
    return 0 if cfg.data.eval_dataset else samples_per_rollout(cfg)


def engine_spec(cfg: PPOConfig, single_process: bool = False) -> EngineSpec:
    """The rollout engines: vLLM with --vllm_num_engines N > 0 (train_ppo_ray), else one Transformers engine (always
    in the single-process train_ppo)."""
    m, r, d = cfg.model, cfg.rollout, cfg.data
    backend = engine_backend(cfg, single_process)
    vllm = backend == "vllm"
    mode, _ = lora_sync_mode(r.lora_sync, m.lora_rank, backend)
    return EngineSpec(backend=backend, model=m.pretrain, lora_rank=m.lora_rank if mode == "adapter" else 0,
                      use_fast_tokenizer=not m.disable_fast_tokenizer, bf16=m.bf16,
                      attn_implementation="flash_attention_2" if m.flash_attn else m.attn_implementation,
                      max_batch_size=max(r.micro_rollout_batch_size, HF_ENGINE_MIN_BATCH),
                      num_engines=r.vllm_num_engines if vllm else 1, tensor_parallel_size=r.vllm_tensor_parallel_size,
                      gpu_memory_utilization=r.vllm_gpu_memory_utilization, enforce_eager=r.enforce_eager,
                      enable_prefix_caching=r.enable_prefix_caching, seed=cfg.strategy.seed,
                      max_model_len=d.prompt_max_len + d.generate_max_len + 1, enable_sleep=r.vllm_enable_sleep,
                      generate_batch=generate_batch(cfg))


def placement_spec(cfg: PPOConfig) -> PlacementSpec:
    """Roles the run does not have are left out whatever their device flags say (OpenRLHF commands pass 0 for
    them); a colocated role given 0 devices runs on its host's devices (`role_ranks`)."""
    res, engine = cfg.resources, engine_spec(cfg)
    offload = {"actor": res.deepspeed_enable_sleep, "critic": res.deepspeed_enable_sleep,
               "ref": res.ref_reward_offload, "reward": res.ref_reward_offload, "teacher": res.ref_reward_offload}
    roles = tuple((role, role_ranks(cfg, role)) for role in ROLES if role_needed(cfg, role))
    return PlacementSpec(role_ranks=roles, engine_role=engine.placement_role, engine_ranks=engine.num_engines,
                         engine_devices_per_rank=engine.devices_per_engine, colocate_all=res.colocate_all_models,
                         colocate_actor_ref=res.colocate_actor_ref, colocate_critic_reward=res.colocate_critic_reward,
                         offload_between_calls=tuple(role for role, _ in roles if offload[role]),
                         sync_backend=cfg.rollout.vllm_sync_backend, ddp_timeout=cfg.strategy.ddp_timeout)


def rl_specs(cfg: PPOConfig, single_process: bool = False) -> RLSpecs:
    """Every spec of the run (a role the run does not have is None); `single_process`: train_ppo's run, every role
    in one process with the Transformers engine."""
    return RLSpecs(actor=actor_spec(cfg), critic=critic_spec(cfg) if needs_critic(cfg) else None,
                   ref=reference_spec(cfg) if needs_reference(cfg) else None,
                   reward=reward_spec(cfg) if cfg.rl_model.reward_pretrain else None,
                   engine=engine_spec(cfg, single_process), placement=placement_spec(cfg),
                   teacher=teacher_spec(cfg) if cfg.distill.teacher_pretrain else None)
