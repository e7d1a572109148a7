"""`run_ppo(cfg)`: assemble the single-process RL run (every role a local object, the Transformers rollout engine)
and train it: the RL trainer whose batch supply is the run's rollout source and whose weight sync hands the actor's
state dict to the engine, on the shared loop (`rlhfkit.rl.loop`).

Order matters for failing fast: the config, the data and the reward source are checked before any model loads.
"""

from __future__ import annotations

from typing import Any

from rlhfkit.config.rl import PPOConfig, validate_single_process
from rlhfkit.config.rl_specs import rl_specs
from rlhfkit.logging.metrics import MetricsLogger
from rlhfkit.rl.loop import RoleHandles, rl_settings
from rlhfkit.rl.trainer import RLTrainer
from rlhfkit.run.loop import TrainingLoop


def run_ppo(cfg: PPOConfig) -> RLTrainer:
    """Validate, load data, build the roles and the engine, train, and save the final model(s)."""
    from rlhfkit.models.moe import check_aux_loss_coef
    from rlhfkit.rl.rollout_source import RolloutSource
    from rlhfkit.rl.teacher import check_distillation
    from rlhfkit.rl.weight_sync import LocalWeightSync
    from rlhfkit.run.setup import build_strategy, load_rl_inputs, prepare_rl_run, train_rl

    cfg.check_inputs()  # the flags were validated when parsed
    validate_single_process(cfg)
    run = prepare_rl_run(cfg, "ppo")
    check_aux_loss_coef(cfg.algo.aux_loss_coef, cfg.model.pretrain)
    inputs = load_rl_inputs(cfg)
    try:
        check_distillation(cfg, inputs.tokenizer)  # before any model loads
        strategy = build_strategy(cfg.model, cfg.strategy)
        specs = rl_specs(cfg, single_process=True)
        roles = local_roles(cfg, inputs, strategy)

        def assemble(logger: MetricsLogger) -> TrainingLoop:  # synchronous: the rollout source is the batch supply
            source = RolloutSource(cfg, roles.engine, roles.reward, inputs.tokenizer, inputs.prompts)
            sync = LocalWeightSync(roles.actor, roles.engine, adapter=specs.engine.lora_rank > 0)
            trainer = RLTrainer(cfg, roles.actor, source, sync, source, logger, strategy, ref=roles.ref,
                                critic=roles.critic, eval_prompts=inputs.eval_prompts, teacher=roles.teacher)
            return TrainingLoop(trainer, rl_settings(cfg), strategy, logger, run)

        def describe(loop: TrainingLoop) -> None:
            text_reward = inputs.text_reward
            reward = type(text_reward).__name__ if text_reward is not None else "model" if roles.reward else "agent"
            strategy.print(f"{cfg.algo.advantage_estimator}: {len(inputs.prompts)} prompts, {loop.total_steps()} "
                           f"RL steps of {cfg.rollout.rollout_batch_size} prompts x {cfg.rollout.n_samples_per_prompt} "
                           f"samples, {inputs.num_update_steps} optimizer steps; roles: actor"
                           f"{', critic' if roles.critic else ''}{', reference' if roles.ref else ''}"
                           f"{', teacher' if roles.teacher else ''}, reward {reward}")

        return train_rl(cfg, strategy, "ppo", assemble, before_fit=describe)
    finally:
        inputs.close()


def local_roles(cfg: PPOConfig, inputs: Any, strategy: Any) -> RoleHandles:
    """Every role a local object of this process, built from its spec, and the Transformers rollout engine on the
    strategy's device (the one engine constructor, handed the agents' episode runner)."""
    from rlhfkit.agents.episodes import run_episodes
    from rlhfkit.rl.roles import ActorRole, CriticRole, ReferenceRole, RewardModelRole
    from rlhfkit.rl.teacher import TeacherRole, http_teacher
    from rlhfkit.rollout.factory import local_engine

    steps, text_reward, specs = inputs.num_update_steps, inputs.text_reward, rl_specs(cfg, single_process=True)
    return RoleHandles(
        actor=ActorRole(specs.actor, steps),
        engine=local_engine(specs.engine, use_gpu=False, tokenizer=inputs.tokenizer, device=strategy.device,
                            episode_runner=run_episodes),
        reward=text_reward if text_reward is not None else RewardModelRole(specs.reward) if specs.reward
        else None,  # None: agent episodes bring their rewards
        ref=ReferenceRole(specs.ref) if specs.ref else None,
        critic=CriticRole(specs.critic, steps) if specs.critic else None,
        teacher=TeacherRole(specs.teacher) if specs.teacher else http_teacher(cfg),
    )
