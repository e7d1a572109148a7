"""The terms the actor adds to its policy loss besides entropy and MoE balancing, each from a micro-batch
(`roles.ActorRole._micro_step`): the KL loss to the reference (`--use_kl_loss`) and the on-policy distillation loss
(`--teacher_pretrain` / `--teacher_url`, `rlhfkit.algorithms.distill_loss`). Each gives (term or None, stats)."""

from __future__ import annotations

from typing import Any

import torch

from rlhfkit.algorithms.distill_loss import distillation_loss
from rlhfkit.algorithms.kl import compute_approx_kl
from rlhfkit.algorithms.masking import aggregate_loss
from rlhfkit.config.specs import ActorSpec
from rlhfkit.rl.experience import Experience

KL_LOG_RATIO_CLAMP = 10.0  # bounds exp() in the k3 KL loss when policy and reference drift far apart
Term = tuple[torch.Tensor | None, dict[str, float]]


def kl_loss_term(spec: ActorSpec, logp: torch.Tensor, micro: Experience, agg: str, agg_kwargs: dict[str, Any]
                 ) -> Term:
    """The KL to the reference as a loss (--use_kl_loss), aggregated like the policy loss."""
    if not spec.use_kl_loss or micro.base_action_log_probs is None:
        return None, {}
    kl = compute_approx_kl(logp, micro.base_action_log_probs, spec.kl_estimator, micro.action_mask,
                           clamp=KL_LOG_RATIO_CLAMP)
    kl_loss = aggregate_loss(kl, micro.action_mask, agg, **agg_kwargs)
    return kl_loss, {"kl_loss": kl_loss.item()}


def distill_term(spec: ActorSpec, logits: torch.Tensor | None, logp: torch.Tensor, micro: Experience, agg: str,
                 agg_kwargs: dict[str, Any]) -> Term:
    """The distillation loss against the teacher's scores in the micro-batch (none without a teacher). Feedback
    tokens of agent episodes have action_mask 0, so only the student's own tokens are distilled. `logits` is None
    under sequence parallelism, which the config layer refuses with a teacher."""
    if spec.distill_loss is None:
        return None, {}
    if logits is None:
        raise ValueError("distillation needs the actor's whole logits (not sequence parallel)")
    loss, info = distillation_loss(spec.distill_loss, logits, logp, micro.action_mask,
                                   teacher_logp=micro.teacher_log_probs, topk_ids=micro.teacher_topk_ids,
                                   topk_logp=micro.teacher_topk_log_probs, agg=agg, **agg_kwargs)
    return loss, {"distill_loss": loss.item(), **{f"distill_{k}": float(v) for k, v in info.items()}}
