"""`run_ppo(cfg)`: assemble the single-process RL run (every role a local object, the Transformers rollout engine)
and train it.

Order matters for failing fast: the config, the data and the reward source are checked before any model loads.
"""

from __future__ import annotations

from typing import Any

import torch

from rlhfkit.config.base import required
from rlhfkit.config.rl import PPOConfig, needs_critic, needs_reference, validate_single_process


def run_ppo(cfg: PPOConfig) -> Any:
    """Validate, load data, build the roles and the engine, train, and save the final model(s)."""
    from rlhfkit.models.loading import resolve_attn_implementation
    from rlhfkit.models.moe import check_aux_loss_coef
    from rlhfkit.rl.loop import RLTrainer, RoleHandles
    from rlhfkit.rl.roles import ActorRole, CriticRole, ReferenceRole, RewardModelRole
    from rlhfkit.rollout.hf_engine import HFRolloutEngine
    from rlhfkit.run.setup import build_strategy, load_rl_inputs, prepare_rl_run, train_rl

    cfg.check_inputs()  # the flags were validated when parsed
    validate_single_process(cfg)
    run = prepare_rl_run(cfg, "ppo")
    check_aux_loss_coef(cfg.algo.aux_loss_coef, cfg.model.pretrain)
    inputs = load_rl_inputs(cfg)
    try:
        strategy = build_strategy(cfg.model, cfg.strategy)
        if cfg.rollout.vllm_num_engines > 0:
            strategy.print("train_ppo: --vllm_num_engines applies to train_ppo_ray; this single-process run "
                           "generates with the Transformers engine")
        steps, text_reward = inputs.num_update_steps, inputs.text_reward
        roles = RoleHandles(
            actor=ActorRole(cfg, steps),
            engine=HFRolloutEngine.from_pretrained(
                required(cfg.model.pretrain, "pretrain"), inputs.tokenizer,
                dtype=torch.bfloat16 if cfg.model.bf16 else torch.float32,
                attn_implementation=resolve_attn_implementation(cfg.model.attn_implementation, cfg.model.flash_attn),
                max_batch_size=max(cfg.rollout.micro_rollout_batch_size, 256), device=strategy.device),
            reward=text_reward if text_reward is not None else RewardModelRole(cfg) if cfg.rl_model.reward_pretrain
            else None,  # None: agent episodes bring their rewards
            ref=ReferenceRole(cfg) if needs_reference(cfg) else None,
            critic=CriticRole(cfg, steps) if needs_critic(cfg) else None,
        )

        def describe(trainer: RLTrainer) -> None:
            reward = type(text_reward).__name__ if text_reward is not None else "model" if roles.reward else "agent"
            strategy.print(f"{cfg.algo.advantage_estimator}: {len(inputs.prompts)} prompts, {trainer.total_steps()} "
                           f"RL steps of {cfg.rollout.rollout_batch_size} prompts x {cfg.rollout.n_samples_per_prompt} "
                           f"samples, {steps} optimizer steps; roles: actor{', critic' if roles.critic else ''}"
                           f"{', reference' if roles.ref else ''}, reward {reward}")

        return train_rl(RLTrainer, cfg, roles, inputs, strategy, run, "ppo", before_fit=describe)
    finally:
        inputs.close()
