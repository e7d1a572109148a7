"""The RL flags that cannot act in the run the other flags describe: `PPOConfig.inert_flags`, which
`rlhfkit.config.base.refuse_inert_flags` turns into one-line errors for the flags the command gave (defaults are
never refused).

Two kinds, one rule: flags bound to a part of the layout the run does not have (the vLLM engine flags with
`--vllm_num_engines 0`, colocation or offloading of a role that is not there, the critic's flags without a critic),
and companions of a feature that is off (`--vllm_is_truncated_threshold` without `--enable_vllm_is_correction`,
`--overlong_penalty_factor` without `--overlong_buffer_len`). Before, each was accepted and silently ignored.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from rlhfkit.config.common import ModelArgs
from rlhfkit.config.rl_resources import ROLES, RLFlags, role_needed
from rlhfkit.config.rl_sections import RecipeArgs


class RunFlags(RLFlags, Protocol):
    """The sections of `rlhfkit.config.rl.PPOConfig` these rules read (a Protocol: `config.rl` imports this module)."""

    @property
    def recipe(self) -> RecipeArgs: ...
    @property
    def model(self) -> ModelArgs: ...

# Flags that only configure vLLM engines (the Transformers engine reads none of them). --vllm_sync_backend is not
# here: with --vllm_num_engines 0, train_ppo_ray's Transformers engine actors receive weights by it too.
VLLM_ENGINE_FLAGS = ("vllm_tensor_parallel_size", "vllm_gpu_memory_utilization", "vllm_enable_sleep", "enforce_eager",
                     "enable_prefix_caching")
# Flags that only act on the critic (PPO's value model, --advantage_estimator gae). --critic_learning_rate is not
# here: OpenRLHF's commands pass both learning rates whatever the estimator, and scripts share them between runs.
CRITIC_FLAGS = ("value_clip", "save_value_network")
# feature flag -> (whether the run has it off, its companions, what turning it on takes)
COMPANIONS: dict[str, tuple[Callable[[RunFlags], bool], tuple[str, ...], str]] = {
    "enable_vllm_is_correction": (lambda c: not c.algo.enable_vllm_is_correction,
                                  ("vllm_is_correction_type", "vllm_is_truncated_threshold"),
                                  "--enable_vllm_is_correction"),
    "dynamic_filtering": (lambda c: not c.recipe.dynamic_filtering,
                          ("dynamic_filtering_reward_range", "dynamic_filtering_max_rounds"), "--dynamic_filtering"),
    "overlong_buffer_len": (lambda c: c.recipe.overlong_buffer_len is None, ("overlong_penalty_factor",),
                            "--overlong_buffer_len N"),
    "kl_target": (lambda c: c.algo.kl_target is None, ("kl_horizon",), "--kl_target KL (the adaptive KL controller)"),
    "lora_rank": (lambda c: c.model.lora_rank == 0, ("lora_sync",), "--lora_rank R (a LoRA policy)"),
}


def inert_flags(cfg: RunFlags) -> dict[str, str]:
    """{flag: why it cannot act} for every flag that does nothing in this run."""
    inert = _layout(cfg)
    if not role_needed(cfg, "critic"):
        for flag in CRITIC_FLAGS:
            inert[flag] = (f"acts on the critic, but --advantage_estimator {cfg.algo.advantage_estimator} trains "
                           "none (only gae does); drop it")
    for off, companions, how in COMPANIONS.values():
        if off(cfg):
            for flag in companions:
                inert[flag] = f"has no effect without {how}; add that or drop it"
    return inert


def _layout(cfg: RLFlags) -> dict[str, str]:
    inert: dict[str, str] = {}
    if cfg.rollout.vllm_num_engines == 0:
        for flag in VLLM_ENGINE_FLAGS:
            inert[flag] = ("configures the vLLM engines, but --vllm_num_engines is 0 (the Transformers engine "
                           "generates); add --vllm_num_engines N or drop it")
    has = {role: role_needed(cfg, role) for role in ROLES}
    if not (has["ref"] or has["teacher"]):
        inert["colocate_actor_ref"] = ("places the reference model (and a teacher), but this run has neither (only "
                                       "a KL term, --init_kl_coef > 0 or --use_kl_loss, needs a reference; "
                                       "--teacher_pretrain names a teacher); drop it")
    if not (has["critic"] and has["reward"]):
        missing = " nor ".join(what for role, what in (("critic", "critic (--advantage_estimator gae)"),
                                                       ("reward", "reward model (--reward_pretrain)"))
                               if not has[role])
        inert["colocate_critic_reward"] = (f"puts the reward model on the critic's devices, but this run has no "
                                           f"{missing}; drop it")
    if not (has["ref"] or has["reward"] or has["teacher"]):
        inert["ref_reward_offload"] = ("offloads the reference, reward and teacher models, but this run has none; "
                                       "drop it")
    return inert

