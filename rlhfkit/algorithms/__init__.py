"""Pure tensor math of post-training: no I/O, no distributed calls.

masking (reductions, loss aggregation), kl (KL estimators and controllers), rewards (reward shaping),
advantages (estimators of the RL loop), policy_loss (PPO actor/critic losses), logprobs (log-probs and entropy
from logits), sft_loss, preference_losses (reward model, DPO/IPO/cDPO, KTO), distill_loss (on-policy
distillation: per-token reverse KL, top-k forward KL).
"""

from rlhfkit.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    compute_advantages,
    discounted_returns,
    gae_advantages_and_returns,
    group_baseline,
)
from rlhfkit.algorithms.distill_loss import (
    DISTILL_LOSSES,
    distillation_loss,
    reverse_kl_loss,
    topk_forward_kl_loss,
)
from rlhfkit.algorithms.kl import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    compute_approx_kl,
    kl_k1,
    kl_k2,
    kl_k3,
    make_kl_controller,
)
from rlhfkit.algorithms.logprobs import entropy_from_logits, token_logprobs
from rlhfkit.algorithms.masking import (
    AGGREGATION_MODES,
    aggregate_loss,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
)
from rlhfkit.algorithms.policy_loss import is_correction_weights, policy_loss, tis_weights, value_loss
from rlhfkit.algorithms.preference_losses import (
    dpo_loss,
    kto_kl_reference_point,
    kto_loss,
    nll_loss,
    pairwise_rm_loss,
)
from rlhfkit.algorithms.rewards import (
    clip_rewards,
    compute_token_rewards,
    grouped,
    groups_in_range,
    last_action_index,
    length_penalty,
    normalize_rewards,
    stop_properly_penalty,
)
from rlhfkit.algorithms.sft_loss import sft_loss, shifted_target_mask

__all__ = [
    "ADVANTAGE_ESTIMATORS", "AGGREGATION_MODES", "KL_ESTIMATORS",
    "AdaptiveKLController", "FixedKLController", "make_kl_controller",
    "aggregate_loss", "masked_mean", "masked_sum", "masked_var", "masked_whiten",
    "compute_approx_kl", "kl_k1", "kl_k2", "kl_k3",
    "clip_rewards", "compute_token_rewards", "grouped", "groups_in_range", "last_action_index",
    "length_penalty", "normalize_rewards", "stop_properly_penalty",
    "compute_advantages", "discounted_returns", "gae_advantages_and_returns", "group_baseline",
    "is_correction_weights", "policy_loss", "tis_weights", "value_loss",
    "entropy_from_logits", "token_logprobs", "sft_loss", "shifted_target_mask",
    "dpo_loss", "kto_kl_reference_point", "kto_loss", "nll_loss", "pairwise_rm_loss",
    "DISTILL_LOSSES", "distillation_loss", "reverse_kl_loss", "topk_forward_kl_loss",
]
