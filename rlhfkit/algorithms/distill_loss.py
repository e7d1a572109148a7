"""On-policy distillation losses: the student (the policy) samples, a teacher scores every sampled token.

Agarwal et al. 2024, "On-Policy Distillation of Language Models: Learning from Self-Generated Mistakes" (GKD):
train the student on its own samples against the teacher's token distribution. Two per-token divergences:

- `reverse_kl_loss`: the per-token reverse KL, KL(student || teacher) at each sampled position, estimated from the
  sampled token y alone (so a teacher that returns only the log-prob of y, over HTTP say, serves it). The loss is
  0.5 * (log pi_s(y) - log pi_t(y))^2, whose gradient (log pi_s(y) - log pi_t(y)) * grad log pi_s(y) is the
  single-sample estimate of grad KL(pi_s || pi_t) at that position when y ~ pi_s (the score-function form
  E_{y~pi_s}[(log pi_s(y) - log pi_t(y)) grad log pi_s(y)]; the future positions' terms are left out, as in
  on-policy distillation). The metric is the k1 estimate, the mean of log pi_s(y) - log pi_t(y).
- `topk_forward_kl_loss`: the forward KL from the teacher's top-k tokens at each position, renormalised to sum to
  one (q), to the student: sum_k q_k (log q_k - log pi_s(v_k)) (GKD's forward-KL/supervised end, restricted to
  the k tokens a teacher endpoint can afford to send). It is >= 0 and 0 exactly when the student puts q on them.

Both take action tensors [B, R] (response tokens; padding and an agent's feedback tokens have mask 0) and reduce
with `aggregate_loss` like the policy loss, so the distillation term adds to an RL objective on the same scale.
"""

from __future__ import annotations

import torch

from rlhfkit.algorithms.masking import aggregate_loss, masked_mean
from rlhfkit.config.names import DISTILL_LOSSES as DISTILL_LOSSES


def _zero_where_masked(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """x at real tokens, 0 elsewhere, so garbage at padding reaches neither the loss nor its gradient."""
    return torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))


def reverse_kl_loss(logp: torch.Tensor, teacher_logp: torch.Tensor, mask: torch.Tensor, agg: str = "token_mean",
                    **agg_kwargs: float | int | torch.Tensor | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token reverse KL of the student's sampled tokens (module docstring). `logp`, `teacher_logp`: [B, R]
    log-probs of the sampled tokens under student and teacher; `agg_kwargs` go to `aggregate_loss`. Returns the
    loss and {"reverse_kl": the k1 estimate, a masked token mean (detached)}."""
    if logp.shape != teacher_logp.shape or logp.shape != mask.shape:
        raise ValueError(f"reverse_kl_loss: logp {tuple(logp.shape)}, teacher_logp {tuple(teacher_logp.shape)} "
                         f"and mask {tuple(mask.shape)} must have one shape")
    log_ratio = _zero_where_masked(logp - teacher_logp.to(logp.dtype), mask)
    loss = aggregate_loss(0.5 * log_ratio.square(), mask, agg, **agg_kwargs)  # type: ignore[arg-type]
    return loss, {"reverse_kl": masked_mean(log_ratio.detach(), mask)}


def topk_forward_kl_loss(logits: torch.Tensor, teacher_topk_ids: torch.Tensor, teacher_topk_logp: torch.Tensor,
                         mask: torch.Tensor, agg: str = "token_mean", **agg_kwargs: float | int | torch.Tensor | None
                         ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Forward KL from the teacher's renormalised top-k tokens to the student (module docstring). `logits`:
    the student's [B, R, V] (temperature applied); `teacher_topk_ids` [B, R, k] and `teacher_topk_logp` [B, R, k]
    the teacher's k most likely tokens and their (full-vocabulary) log-probs. Returns the loss and
    {"topk_forward_kl", "teacher_topk_mass": how much of the teacher's probability the k tokens hold}."""
    if teacher_topk_ids.shape != teacher_topk_logp.shape or teacher_topk_ids.shape[:2] != mask.shape \
            or logits.shape[:2] != mask.shape:
        raise ValueError(f"topk_forward_kl_loss: logits {tuple(logits.shape)}, ids {tuple(teacher_topk_ids.shape)}, "
                         f"log-probs {tuple(teacher_topk_logp.shape)} and mask {tuple(mask.shape)} disagree")
    real = mask.bool()[..., None]
    logits = torch.where(real, logits, torch.zeros((), dtype=logits.dtype, device=logits.device))
    student = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
    student = student.gather(-1, teacher_topk_ids.long())
    teacher = teacher_topk_logp.to(student.dtype)
    teacher = torch.where(real, teacher, torch.zeros((), dtype=teacher.dtype, device=teacher.device))
    q_log = torch.log_softmax(teacher, dim=-1)  # renormalised over the k tokens
    per_token = (q_log.exp() * (q_log - torch.where(real, student, q_log.detach()))).sum(dim=-1)
    loss = aggregate_loss(per_token, mask, agg, **agg_kwargs)  # type: ignore[arg-type]
    mass = masked_mean(teacher.exp().sum(dim=-1), mask)
    return loss, {"topk_forward_kl": masked_mean(per_token.detach(), mask), "teacher_topk_mass": mass}


def distillation_loss(kind: str, logits: torch.Tensor, logp: torch.Tensor, mask: torch.Tensor, *,
                      teacher_logp: torch.Tensor | None = None, topk_ids: torch.Tensor | None = None,
                      topk_logp: torch.Tensor | None = None, agg: str = "token_mean",
                      **agg_kwargs: float | int | torch.Tensor | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The `kind` loss (`DISTILL_LOSSES`) from the student's logits [B, R, V] / sampled-token log-probs [B, R] and
    what the teacher gave for it."""
    if kind == "reverse_kl":
        if teacher_logp is None:
            raise ValueError("reverse_kl needs the teacher's log-probs of the sampled tokens")
        return reverse_kl_loss(logp, teacher_logp, mask, agg, **agg_kwargs)
    if kind == "topk_forward_kl":
        if topk_ids is None or topk_logp is None:
            raise ValueError("topk_forward_kl needs the teacher's top-k token ids and log-probs")
        return topk_forward_kl_loss(logits, topk_ids, topk_logp, mask, agg, **agg_kwargs)
    raise ValueError(f"unknown distillation loss {kind!r}; expected one of {DISTILL_LOSSES}")
