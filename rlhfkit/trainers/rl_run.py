"""`run_ppo(cfg)`: assemble the single-process RL run (every role a local object, the Transformers rollout engine)
and train it.

Order matters for failing fast: the config, the data and the reward source are checked before any model loads.
"""

from __future__ import annotations

from typing import Any

import torch

from rlhfkit.config.rl import (
    PPOConfig,
    needs_critic,
    needs_reference,
    validate_rl_config,
    validate_single_process,
)


def run_ppo(cfg: PPOConfig) -> Any:
    """Validate, load data, build the roles and the engine, train, and save the final model(s)."""
    from rlhfkit.models.loading import resolve_attn_implementation
    from rlhfkit.models.moe import check_aux_loss_coef
    from rlhfkit.rollout.hf_engine import HFRolloutEngine
    from rlhfkit.trainers.rl_loop import RLTrainer, RoleHandles
    from rlhfkit.trainers.roles import ActorRole, CriticRole, ReferenceRole, RewardModelRole
    from rlhfkit.trainers.setup import (
        load_prompts,
        load_tokenizer_for,
        make_logger,
        make_strategy,
        make_text_reward,
        num_update_steps,
        prepare_run,
    )

    validate_rl_config(cfg)
    validate_single_process(cfg)
    run = prepare_run(cfg, "ppo")
    check_aux_loss_coef(cfg.algo.aux_loss_coef, cfg.model.pretrain, cfg.data.packing_samples)
    tokenizer = load_tokenizer_for(cfg.model)
    prompts, eval_prompts = load_prompts(cfg, tokenizer)
    text_reward = make_text_reward(cfg) if not cfg.rl_model.reward_pretrain else None
    strategy = make_strategy(cfg.model, cfg.strategy)
    strategy.setup_distributed()
    if cfg.rollout.vllm_num_engines > 0:
        strategy.print("train_ppo: --vllm_num_engines applies to train_ppo_ray; this single-process run generates "
                       "with the Transformers engine")
    steps = num_update_steps(cfg, len(prompts))
    actor = ActorRole(cfg, steps)
    roles = RoleHandles(
        actor=actor,
        engine=HFRolloutEngine.from_pretrained(
            cfg.model.pretrain, tokenizer, dtype=torch.bfloat16 if cfg.model.bf16 else torch.float32,
            attn_implementation=resolve_attn_implementation(cfg.model.attn_implementation, cfg.model.flash_attn),
            max_batch_size=max(cfg.rollout.micro_rollout_batch_size, 256), device=strategy.device),
        reward=text_reward if text_reward is not None else RewardModelRole(cfg) if cfg.rl_model.reward_pretrain
        else None,  # None: agent episodes bring their rewards
        ref=ReferenceRole(cfg) if needs_reference(cfg) else None,
        critic=CriticRole(cfg, steps) if needs_critic(cfg) else None,
    )
    logger = make_logger(strategy, cfg.logging, cfg.checkpoint.save_path, "ppo", cfg)
    n = cfg.rollout.n_samples_per_prompt
    trainer = RLTrainer(cfg, roles, tokenizer, prompts, eval_prompts, logger, strategy, run=run)
    strategy.print(f"{cfg.algo.advantage_estimator}: {len(prompts)} prompts, {trainer.total_steps()} RL steps of "
                   f"{cfg.rollout.rollout_batch_size} prompts x {n} samples, {steps} optimizer steps; roles: "
                   f"actor{', critic' if roles.critic else ''}{', reference' if roles.ref else ''}, reward "
                   f"{type(text_reward).__name__ if text_reward is not None else 'model' if roles.reward else 'agent'}")
    try:
        trainer.fit()
        trainer.save_final()
    finally:
        logger.close()
        if hasattr(text_reward, "close"):
            text_reward.close()
    strategy.print(f"{cfg.algo.advantage_estimator}: model saved to {cfg.checkpoint.save_path}; metrics in "
                   f"{logger.path}")
    return trainer
