"""Losses on preference data: the pairwise reward-model loss, DPO and its variants (cDPO, IPO), the NLL term,
the reference-free SimPO and ORPO, and KTO.

Inputs are per-sample tensors [B]: rewards from a reward head, or sequence log-probs, i.e. the sum of the
per-token log-probs of the response tokens (`token_logprobs` summed under the loss mask), of the policy and of
the frozen reference model; SimPO and ORPO take the per-token mean log-probs of the policy alone. Losses are
means over the batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rlhfkit.config.names import RM_LOSS_KINDS as RM_LOSS_KINDS  # pairwise_rm_loss dispatches on these


def pairwise_rm_loss(chosen_reward: torch.Tensor, rejected_reward: torch.Tensor,
                     margin: torch.Tensor | float | None = None, kind: str = "sigmoid",
                     reduction: str = "mean") -> torch.Tensor:
    """Bradley-Terry loss of a reward model on (chosen, rejected) pairs (Ouyang et al. 2022, InstructGPT).

    - `sigmoid`: -log sigmoid(r_c - r_r - margin)
    - `logexp`:  log(1 + exp(r_r - r_c + margin))
    The two are the same function written two ways (log(1 + e^-x) = -log sigmoid(x)); both are computed in the
    overflow-free form. margin (per pair or scalar) asks the chosen reward to win by at least that much (Llama 2,
    Touvron et al. 2023). reduction: `mean` (scalar) or `none` ([B]).
    """
    if kind not in RM_LOSS_KINDS:
        raise ValueError(f"unknown reward-model loss {kind!r}; expected one of {RM_LOSS_KINDS}")
    difference = chosen_reward - rejected_reward
    if margin is not None:
        difference = difference - margin
    losses = -F.logsigmoid(difference) if kind == "sigmoid" else F.softplus(-difference)
    if reduction == "none":
        return losses
    if reduction != "mean":
        raise ValueError(f"unknown reduction {reduction!r}; expected mean or none")
    return losses.mean()


def dpo_loss(policy_chosen_logps: torch.Tensor, policy_rejected_logps: torch.Tensor,
             ref_chosen_logps: torch.Tensor, ref_rejected_logps: torch.Tensor, beta: float,
             label_smoothing: float = 0.0, ipo: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Direct Preference Optimization loss and its implicit rewards; returns (loss, chosen_rewards, rejected_rewards).

    With h = (log pi(y_c) - log ref(y_c)) - (log pi(y_r) - log ref(y_r)), per pair:
    - DPO (Rafailov et al. 2023): -log sigmoid(beta * h).
    - cDPO (Mitchell 2023, "A note on DPO with noisy preferences"), label_smoothing = eps in [0, 0.5):
      -(1 - eps) * log sigmoid(beta * h) - eps * log sigmoid(-beta * h).
    - IPO (Azar et al. 2023, "A General Theoretical Paradigm to Understand Learning from Human Preferences"):
      (h - 1 / (2 * beta))^2. h is built from whatever log-probs are passed; the IPO paper's practice is the mean
      per-token log-prob of each response, pass those for it (sums give the same loss shape on a longer scale).
    loss is the mean over pairs. chosen_rewards = beta * (log pi(y_c) - log ref(y_c)) and rejected_rewards likewise,
    both [B] and detached (for accuracy and margin metrics).
    """
    if beta <= 0:
        raise ValueError(f"DPO's beta must be > 0 (got {beta})")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"cDPO's label_smoothing is a flip probability in [0, 0.5) (got {label_smoothing})")
    if ipo and label_smoothing > 0:
        raise ValueError("IPO has no label smoothing (cDPO is a DPO variant); got ipo=True with "
                         f"label_smoothing={label_smoothing}")
    chosen_log_ratio = policy_chosen_logps - ref_chosen_logps
    rejected_log_ratio = policy_rejected_logps - ref_rejected_logps
    h = chosen_log_ratio - rejected_log_ratio
    if ipo:
        losses = (h - 1.0 / (2.0 * beta)) ** 2
    else:
        losses = -(1.0 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)
    return losses.mean(), (beta * chosen_log_ratio).detach(), (beta * rejected_log_ratio).detach()


def nll_loss(chosen_logps_sum: torch.Tensor, chosen_num_tokens: torch.Tensor) -> torch.Tensor:
    """Mean over samples of the per-token negative log-likelihood, -(sum of log-probs) / (number of tokens).

    The SFT term on the chosen responses added to DPO (`--nll_loss_coef`; Pang et al. 2024, "Iterative Reasoning
    Preference Optimization", RPO). chosen_num_tokens [B] counts the response tokens (floored at 1).
    """
    return (-chosen_logps_sum / chosen_num_tokens.clamp(min=1).to(chosen_logps_sum.dtype)).mean()


def simpo_loss(chosen_avg_logps: torch.Tensor, rejected_avg_logps: torch.Tensor, beta: float,
               gamma: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SimPO loss (Meng et al. 2024, "SimPO: Simple Preference Optimization with a Reference-Free Reward");
    returns (loss, chosen_rewards, rejected_rewards).

    The implicit reward is the length-normalised log-likelihood r(y) = beta * (1 / |y|) * log pi(y), with no
    reference model; with a target reward margin gamma, per pair:
        -log sigmoid(r(y_c) - r(y_r) - gamma)
    chosen_avg_logps / rejected_avg_logps [B] are the per-token mean log-probs (1 / |y|) log pi(y). loss is the mean
    over pairs; the rewards beta * mean log-prob are [B] and detached. (TRL's CPO trainer with loss_type simpo:
    `simpo_gamma` is gamma in reward units, the same as here.)
    """
    if beta <= 0:
        raise ValueError(f"SimPO's beta must be > 0 (got {beta})")
    chosen_rewards = beta * chosen_avg_logps
    rejected_rewards = beta * rejected_avg_logps
    losses = -F.logsigmoid(chosen_rewards - rejected_rewards - gamma)
    return losses.mean(), chosen_rewards.detach(), rejected_rewards.detach()


def log_odds(avg_logps: torch.Tensor) -> torch.Tensor:
    """log(p / (1 - p)) of p = exp(avg_logps) <= 1, computed without cancellation: log p - log(1 - exp(log p)).

    log(1 - e^a) is log(-expm1(a)) near 0 and log1p(-e^a) below -log 2 (Maechler 2012, "Accurately Computing
    log(1 - exp(-|a|))"). a is capped at -1e-6 so a response the model is certain of (p = 1 in floating point) gives
    a large finite odds instead of inf.
    """
    a = avg_logps.clamp(max=-1e-6)
    log1mexp = torch.where(a > -0.6931471805599453, torch.log(-torch.expm1(a)), torch.log1p(-torch.exp(a)))
    return a - log1mexp


def orpo_loss(chosen_avg_logps: torch.Tensor, rejected_avg_logps: torch.Tensor, lam: float
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ORPO loss (Hong et al. 2024, "ORPO: Monolithic Preference Optimization without Reference Model"); returns
    (loss, chosen_rewards, rejected_rewards).

    With P(y) = exp((1 / |y|) log pi(y)) (the length-normalised likelihood) and odds(y) = P / (1 - P), per pair:
        -(1 / |y_c|) log pi(y_c) - lam * log sigmoid(log odds(y_c) - log odds(y_r))
    i.e. the SFT negative log-likelihood of the chosen response plus lam times the odds-ratio term; no reference
    model. The inputs are the per-token mean log-probs [B]; loss is the mean over pairs; the rewards
    lam * mean log-prob (TRL's convention for ORPO's metrics) are [B] and detached. TRL's ORPO calls lam `beta`.
    """
    if lam <= 0:
        raise ValueError(f"ORPO's lambda must be > 0 (got {lam})")
    nll = -chosen_avg_logps
    odds_ratio = -F.logsigmoid(log_odds(chosen_avg_logps) - log_odds(rejected_avg_logps))
    losses = nll + lam * odds_ratio
    return losses.mean(), (lam * chosen_avg_logps).detach(), (lam * rejected_avg_logps).detach()


def kto_kl_reference_point(policy_kl_logps: torch.Tensor, ref_kl_logps: torch.Tensor) -> torch.Tensor:
    """The reference point z0 of KTO: mean(log pi(y'|x) - log ref(y'|x)) over mismatched pairs, clamped at 0,
    detached (Ethayarajh et al. 2024, "KTO: Model Alignment as Prospect Theoretic Optimization").

    The pairs (x, y') combine a prompt with the response of another sample of the batch, an estimate of
    KL(pi || ref). In data-parallel training, average it over ranks before passing it to kto_loss.
    """
    return (policy_kl_logps - ref_kl_logps).mean().clamp(min=0).detach()


def kto_loss(policy_logps: torch.Tensor, ref_logps: torch.Tensor, labels: torch.Tensor,
             kl_ref_point: torch.Tensor | float, beta: float, desirable_weight: float = 1.0,
             undesirable_weight: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Kahneman-Tversky Optimization loss (Ethayarajh et al. 2024); returns (loss, rewards).

    With r = log pi(y|x) - log ref(y|x) and z0 = kl_ref_point (detached, clamped at 0), per sample:
        desirable   (label True):  desirable_weight   * (1 - sigmoid(beta * (r - z0)))
        undesirable (label False): undesirable_weight * (1 - sigmoid(beta * (z0 - r)))
    loss is the mean over all samples; rewards = beta * r, [B], detached (split them by label for metrics).
    """
    if beta <= 0:
        raise ValueError(f"KTO's beta must be > 0 (got {beta})")
    log_ratio = policy_logps - ref_logps
    z0 = torch.as_tensor(kl_ref_point, dtype=log_ratio.dtype, device=log_ratio.device).detach().clamp(min=0)
    desirable = labels.bool()
    desirable_losses = desirable_weight * (1.0 - torch.sigmoid(beta * (log_ratio - z0)))
    undesirable_losses = undesirable_weight * (1.0 - torch.sigmoid(beta * (z0 - log_ratio)))
    losses = torch.where(desirable, desirable_losses, undesirable_losses)
    return losses.mean(), (beta * log_ratio).detach()
