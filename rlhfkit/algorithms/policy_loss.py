"""Actor and critic losses of the RL loop: the PPO clipped surrogate with its variants (asymmetric clip, dual
clip, GSPO's sequence-level ratio, importance-sampling corrections tis / icepop / seq-mask-tis), CISPO's clipped
importance-sampling weights, SAPO's soft gate, and the clipped value loss. (The entropy bonus,
`entropy_from_logits`, lives in logprobs.py and is re-exported here.)

Token tensors are [B, T] aligned with the action mask. The `info` dicts hold detached 0-dim tensors (no
host sync here: call .item() when logging).
"""

from __future__ import annotations

import torch

from rlhfkit.algorithms.logprobs import entropy_from_logits as entropy_from_logits  # the PPO entropy bonus
from rlhfkit.algorithms.masking import aggregate_loss, masked_mean
from rlhfkit.config.names import IS_CORRECTIONS as IS_CORRECTIONS  # is_correction_weights dispatches
from rlhfkit.config.names import POLICY_LOSS_TYPES as POLICY_LOSS_TYPES  # policy_loss dispatches

MAX_LOG_RATIO = 20.0


def _masked(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """x with masked positions replaced by 0 before any nonlinearity, so padding can't put NaN in a gradient."""
    return torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))


def tis_weights(old_logp: torch.Tensor, rollout_logp: torch.Tensor, cap: float) -> torch.Tensor:
    """Truncated importance-sampling weights min(exp(old_logp - rollout_logp), cap), detached.

    The rollout engine (vLLM) and the trainer compute slightly different probabilities for the same tokens, so the
    samples are off-policy for the trainer's old policy; Yao et al. 2025 ("Your Efficient RL Framework Secretly
    Brings You Off-Policy RL Training") correct the policy gradient with this truncated ratio.
    """
    if cap <= 0:
        raise ValueError(f"the truncated importance-sampling cap must be > 0 (got {cap})")
    log_ratio = old_logp.detach().float() - rollout_logp.detach().float()
    return torch.exp(log_ratio).clamp(max=cap)


def is_correction_weights(old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor, kind: str,
                          low: float, high: float) -> torch.Tensor:
    """Detached per-token weights [B, T] correcting the engine/trainer mismatch (0 outside the mask).

    With r_t = exp(old_logp_t - rollout_logp_t) (trainer's old policy over the engine's sampling policy):
    - "tis", truncated importance sampling (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You
      Off-Policy RL Training"): w_t = clamp(r_t, low, high) (OpenRLHF's definition; low = 0 is the plain cap
      min(r_t, high)).
    - "icepop" (Ling Team 2025, "Every Step Evolves: Scaling Reinforcement Learning for Trillion-Scale Thinking
      Model", the Ring-1T report, arXiv 2510.18855): w_t = r_t if low <= r_t <= high else 0, i.e. tokens with a
      too large mismatch are masked out instead of truncated.
    - "seq-mask-tis": the sequence's geometric-mean ratio g = exp(mean over its action tokens of log r_t); the
      whole sequence is masked (w_t = 0) when g is outside [low, high], otherwise w_t = r_t (OpenRLHF's
      definition, which keeps the untruncated token ratio inside the band).
    """
    if kind not in IS_CORRECTIONS:
        raise ValueError(f"unknown importance-sampling correction {kind!r}; expected one of {IS_CORRECTIONS}")
    if not 0 <= low < high:
        raise ValueError(f"importance-sampling thresholds need 0 <= low < high (got {low}, {high})")
    dtype = torch.promote_types(old_logp.dtype, torch.float32)  # float64 inputs keep their precision
    log_ratio = _masked(old_logp.detach().to(dtype) - rollout_logp.detach().to(dtype), mask)
    ratio = torch.exp(log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
    if kind == "tis":
        weights = ratio.clamp(min=low, max=high)
    elif kind == "icepop":
        weights = torch.where((ratio >= low) & (ratio <= high), ratio, torch.zeros_like(ratio))
    else:
        seq_ratio = torch.exp(masked_mean(log_ratio, mask, dim=-1))
        keep = (seq_ratio >= low) & (seq_ratio <= high)
        weights = ratio * keep[:, None].to(ratio.dtype)
    return _masked(weights, mask)


def sequence_log_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B] mean over each response's action tokens of (logp - old_logp): GSPO's length-normalised log ratio."""
    diff = _masked(logp - old_logp.detach(), mask)
    return diff.sum(dim=-1) / mask.sum(dim=-1).clamp(min=1).to(diff.dtype)


def cispo_token_loss(logp: torch.Tensor, ratio: torch.Tensor, advantages: torch.Tensor, clip_eps_low: float,
                     clip_eps_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """CISPO's per-token loss and its clipped mask (MiniMax 2025, "MiniMax-M1: Scaling Test-Time Compute
    Efficiently with Lightning Attention", arXiv 2506.13585, eq. 4-5).

        loss_t = -sg(clip(ratio_t, 1 - clip_eps_low, 1 + clip_eps_high)) * A_t * logp_t
    A REINFORCE-style term whose importance-sampling weight is clipped and detached (sg: stop-gradient): unlike
    PPO's clip, which zeroes the gradient of a token whose ratio left the band, every token keeps its gradient
    (weighted by at most 1 + clip_eps_high), so rare tokens that matter ("However", "Wait") still learn. The paper
    drops the lower bound (a large eps_low; clip_eps_low >= 1 does that) and tunes only eps_high.
    Returns (loss [B, T], clipped [B, T]: the tokens whose weight was clipped).
    """
    weight = ratio.detach().clamp(1.0 - clip_eps_low, 1.0 + clip_eps_high)
    return -weight * advantages * logp, weight != ratio.detach()


def sapo_token_loss(ratio: torch.Tensor, advantages: torch.Tensor, tau_pos: float, tau_neg: float) -> torch.Tensor:
    """SAPO's per-token loss (Gao et al. 2025, "Soft Adaptive Policy Optimization", arXiv 2511.20347, eq. 5-6).

        loss_t = -f(ratio_t) * A_t,  f(r) = (4 / tau) * sigmoid(tau * (r - 1)),  tau = tau_pos if A_t > 0 else tau_neg
    A smooth, temperature-controlled gate in place of PPO's hard clip: the gradient is
    -4 * s * (1 - s) * ratio * A * grad(logp) with s = sigmoid(tau * (ratio - 1)), exactly the policy gradient at
    ratio = 1 and fading smoothly as the ratio leaves it (faster for a larger tau). tau_neg > tau_pos damps the
    updates of negative-advantage tokens more, as the paper recommends (its defaults: 1.0 and 1.05).
    """
    if tau_pos <= 0 or tau_neg <= 0:
        raise ValueError(f"SAPO's temperatures must be > 0 (got tau_pos={tau_pos}, tau_neg={tau_neg})")
    tau = torch.where(advantages > 0, torch.full_like(ratio, tau_pos), torch.full_like(ratio, tau_neg))
    return -(4.0 / tau) * torch.sigmoid(tau * (ratio - 1.0)) * advantages


def _check_policy_loss_args(clip_eps_low: float, clip_eps_high: float, dual_clip: float | None, loss_type: str,
                            rollout_logp: torch.Tensor | None, tis_cap: float | None) -> None:
    if clip_eps_low < 0 or clip_eps_high < 0:
        raise ValueError(f"clip epsilons must be >= 0 (got low={clip_eps_low}, high={clip_eps_high})")
    if loss_type not in POLICY_LOSS_TYPES:
        raise ValueError(f"unknown policy loss type {loss_type!r}; expected one of {POLICY_LOSS_TYPES}")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (got {dual_clip}): it bounds the loss of negative advantages "
                         "by dual_clip * |A|")
    if dual_clip is not None and loss_type in ("cispo", "sapo"):
        raise ValueError(f"dual_clip bounds PPO's clipped surrogate; the {loss_type} loss has none")
    if (rollout_logp is None) != (tis_cap is None):
        raise ValueError("truncated importance sampling needs both the rollout log-probs and a cap")
    if tis_cap is not None and tis_cap <= 0:
        raise ValueError(f"the importance-sampling cap must be > 0 (got {tis_cap})")


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *,
                clip_eps_low: float = 0.2, clip_eps_high: float | None = None, dual_clip: float | None = None,
                rollout_logp: torch.Tensor | None = None, tis_cap: float | None = None,
                is_correction: str = "tis", is_low: float = 0.0, loss_type: str = "ppo",
                tau_pos: float = 1.0, tau_neg: float = 1.05,
                agg: str = "token_mean", num_tokens: int | float | torch.Tensor | None = None,
                num_seqs: int | float | torch.Tensor | None = None, norm_len: int | None = None,
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate loss (Schulman et al. 2017, "Proximal Policy Optimization Algorithms"), GSPO's, CISPO's
    or SAPO's.

    Per action token, with ratio = exp(logp - old_logp) (log ratio bounded to +-20) and A the advantage:
        loss_t = -min(ratio * A, clip(ratio, 1 - clip_eps_low, 1 + clip_eps_high) * A)
    - loss_type "gspo" (Zheng et al. 2025, "Group Sequence Policy Optimization"): the ratio is the sequence's
      s_i = exp(mean_t (logp_t - old_logp_t)) over its action tokens, clipped at the sequence level with the
      sequence's advantage; loss_i = -min(s_i * A_i, clip(s_i, 1 - low, 1 + high) * A_i) is put on each of the
      sequence's action tokens and reduced by `agg` (seq_mean_token_mean gives the paper's mean over sequences).
      The gradient flows through every token of the mean, as in the paper's GSPO-token form with equal advantages.
    - loss_type "cispo" (MiniMax-M1, 2025): loss_t = -sg(clip(ratio, 1 - low, 1 + high)) * A * logp_t, see
      `cispo_token_loss`.
    - loss_type "sapo" (Gao et al. 2025): loss_t = -(4 / tau) * sigmoid(tau * (ratio - 1)) * A with tau = tau_pos
      where A > 0, else tau_neg, see `sapo_token_loss` (the clip epsilons only feed the clip_fraction metric).
    - clip_eps_high (default: clip_eps_low) > clip_eps_low is DAPO's clip-higher (Yu et al. 2025).
    - dual_clip = c > 1 (Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep Reinforcement
      Learning"): where A < 0 the loss is also bounded by c * |A|, i.e. loss_t = min(loss_t, -c * A), so a huge
      ratio on a bad token cannot blow the step up (ppo and gspo only).
    - rollout_logp with tis_cap: the per-token loss is multiplied by
      is_correction_weights(old_logp, rollout_logp, mask, is_correction, is_low, tis_cap) (tis / icepop /
      seq-mask-tis, see there).
    The per-token loss is reduced by `aggregate_loss(agg, num_tokens=..., num_seqs=..., norm_len=...)`.
    info: `clip_fraction` (ppo / gspo: tokens where the clipped term is the smaller one, i.e. no gradient; cispo /
    sapo: tokens whose ratio is outside [1 - low, 1 + high], for cispo the tokens whose weight was clipped),
    `dual_clip_fraction` (with dual_clip), `approx_kl` (mean of (ratio - 1) - log ratio, the k3 estimate of
    KL(old || new)), `ratio_mean` and, with a correction, `tis_weight_mean` and `is_masked_fraction` (tokens whose
    weight is 0), all means over the action tokens of this batch.
    """
    clip_eps_high = clip_eps_low if clip_eps_high is None else clip_eps_high
    _check_policy_loss_args(clip_eps_low, clip_eps_high, dual_clip, loss_type, rollout_logp, tis_cap)
    # exp(20) = 4.9e8 is beyond any meaningful ratio; the bound keeps float32 (and its gradient) finite.
    if loss_type == "gspo":
        seq = sequence_log_ratio(logp, old_logp, mask).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
        log_ratio = _masked(seq[:, None].expand_as(logp), mask)
    else:
        log_ratio = _masked(logp - old_logp.detach(), mask).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    advantages = _masked(advantages.detach(), mask)
    ratio = torch.exp(log_ratio)
    info: dict[str, torch.Tensor] = {}
    if loss_type in ("ppo", "gspo"):
        loss, clipped = _clipped_surrogate(ratio, advantages, clip_eps_low, clip_eps_high)
    elif loss_type == "cispo":
        loss, clipped = cispo_token_loss(_masked(logp, mask), ratio, advantages, clip_eps_low, clip_eps_high)
    else:
        loss = sapo_token_loss(ratio, advantages, tau_pos, tau_neg)
        clipped = (ratio < 1.0 - clip_eps_low) | (ratio > 1.0 + clip_eps_high)
    info["clip_fraction"] = masked_mean(clipped.float(), mask)
    if dual_clip is not None:
        bound = -dual_clip * advantages
        info["dual_clip_fraction"] = masked_mean(((advantages < 0) & (loss > bound)).float(), mask)
        loss = torch.where(advantages < 0, torch.min(loss, bound), loss)
    if rollout_logp is not None and tis_cap is not None:  # both or neither (checked above)
        weights = is_correction_weights(old_logp, rollout_logp, mask, is_correction, is_low, tis_cap)
        loss = loss * weights.to(loss.dtype)
        info["tis_weight_mean"] = masked_mean(weights, mask)
        info["is_masked_fraction"] = masked_mean((weights == 0).float(), mask)
    with torch.no_grad():
        info["approx_kl"] = masked_mean((ratio - 1.0) - log_ratio, mask)
        info["ratio_mean"] = masked_mean(ratio, mask)
    reduced = aggregate_loss(loss, mask, agg, num_tokens=num_tokens, num_seqs=num_seqs, norm_len=norm_len)
    return reduced, {k: v.detach() for k, v in info.items()}


def _clipped_surrogate(ratio: torch.Tensor, advantages: torch.Tensor, clip_eps_low: float, clip_eps_high: float
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's per-token -min(ratio * A, clip(ratio) * A) and where the clipped term won (no gradient there)."""
    surr_unclipped = ratio * advantages
    surr_clipped = ratio.clamp(1.0 - clip_eps_low, 1.0 + clip_eps_high) * advantages
    return -torch.min(surr_unclipped, surr_clipped), (surr_clipped < surr_unclipped).detach()


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, *,
               value_clip: float | None = None, agg: str = "token_mean",
               num_tokens: int | float | torch.Tensor | None = None,
               ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Critic loss 0.5 * (V - R)^2, optionally clipped as in PPO (Schulman et al. 2017; OpenAI baselines ppo2).

    With value_clip = c: V_clip = old_V + clip(V - old_V, -c, c) and the per-token loss is
    0.5 * max((V - R)^2, (V_clip - R)^2), so the critic cannot move far from its rollout-time prediction.
    Reduced by `aggregate_loss(agg, num_tokens=...)`. info: `value_clip_fraction` (tokens where the clipped error
    is the larger one) and `value_mean`.
    """
    values = _masked(values, mask)
    returns = _masked(returns.detach(), mask)
    unclipped = (values - returns) ** 2
    info: dict[str, torch.Tensor] = {}
    if value_clip is None:
        per_token = 0.5 * unclipped
    else:
        if value_clip <= 0:
            raise ValueError(f"value_clip must be > 0 or None (got {value_clip})")
        old_values = _masked(old_values.detach(), mask)
        clipped_values = old_values + (values - old_values).clamp(-value_clip, value_clip)
        clipped = (clipped_values - returns) ** 2
        per_token = 0.5 * torch.max(unclipped, clipped)
        info["value_clip_fraction"] = masked_mean((clipped > unclipped).float(), mask).detach()
    info["value_mean"] = masked_mean(values.detach(), mask)
    return aggregate_loss(per_token, mask, agg, num_tokens=num_tokens), info

