"""Advantage estimators of the RL loop, selected by name (`--advantage_estimator`).

Shapes: scalar rewards [B] with B = num_prompts * n_samples_per_prompt, the n samples of one prompt contiguous;
token tensors [B, T] aligned with the action mask (1 = a token the policy generated). Positions outside the mask
are skipped by the recursions (they are not steps of the episode) and hold 0 in every output, so masks with
holes (environment tokens of a multi-turn rollout) are handled; the episode ends after the last action token.
Everything here runs without gradient: advantages and returns are targets.
"""

from __future__ import annotations

import torch

from rlhfkit.algorithms.masking import masked_whiten
from rlhfkit.algorithms.rewards import compute_token_rewards, grouped
from rlhfkit.config.names import ADVANTAGE_ESTIMATORS as ADVANTAGE_ESTIMATORS  # compute_advantages dispatches
from rlhfkit.config.names import GROUP_BASELINES as GROUP_BASELINES  # group_baseline dispatches

# Estimators whose advantages are whitened over the whole batch at the end (the others are group-relative).
BATCH_WHITENED = ("gae", "reinforce", "reinforce_baseline")


def _float(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.promote_types(x.dtype, torch.float32))


@torch.no_grad()
def gae_advantages_and_returns(values: torch.Tensor, token_rewards: torch.Tensor, action_mask: torch.Tensor,
                               gamma: float = 1.0, lambd: float = 0.95) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized Advantage Estimation (Schulman et al. 2016, "High-Dimensional Continuous Control Using
    Generalized Advantage Estimation").

    Over the action tokens of a row, from the last to the first:
        delta_t = r_t + gamma * V_{t+1} - V_t          (V after the last action token = 0: the episode ended)
        A_t     = delta_t + gamma * lambd * A_{t+1}
    returns R_t = A_t + V_t (the critic's regression target). Returns (advantages, returns), both [B, T],
    0 outside the mask.
    """
    mask = action_mask.bool()
    dtype = torch.promote_types(_float(values).dtype, _float(token_rewards).dtype)
    zero = torch.zeros((), dtype=dtype, device=values.device)
    values = torch.where(mask, values.to(dtype), zero)
    rewards = torch.where(mask, token_rewards.to(dtype), zero)
    next_value = torch.zeros(values.shape[0], dtype=dtype, device=values.device)
    running = torch.zeros_like(next_value)
    columns = []
    for t in reversed(range(values.shape[1])):
        step = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        running = torch.where(step, delta + gamma * lambd * running, running)
        next_value = torch.where(step, values[:, t], next_value)
        columns.append(torch.where(step, running, zero))
    advantages = torch.stack(columns[::-1], dim=1)
    returns = torch.where(mask, advantages + values, zero)
    return advantages, returns


@torch.no_grad()
def discounted_returns(token_rewards: torch.Tensor, action_mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """Monte-Carlo returns G_t = r_t + gamma * G_{t+1} over the action tokens (Williams 1992, REINFORCE).

    REINFORCE++ (Hu 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning Large Language Models") uses
    these returns of the KL-shaped token rewards as advantages, whitened over the batch. [B, T], 0 outside the mask.
    """
    mask = action_mask.bool()
    rewards = _float(token_rewards)
    zero = torch.zeros((), dtype=rewards.dtype, device=rewards.device)
    rewards = torch.where(mask, rewards, zero)
    running = torch.zeros(rewards.shape[0], dtype=rewards.dtype, device=rewards.device)
    columns = []
    for t in reversed(range(rewards.shape[1])):
        step = mask[:, t]
        running = torch.where(step, rewards[:, t] + gamma * running, running)
        columns.append(torch.where(step, running, zero))
    return torch.stack(columns[::-1], dim=1)


@torch.no_grad()
def group_baseline(rewards: torch.Tensor, n_samples_per_prompt: int, method: str, std_norm: bool = True,
                   eps: float = 1e-6) -> torch.Tensor:
    """Group-relative scalar rewards [B] over the n samples of each prompt.

    - `reinforce_baseline`: r - mean(group) (REINFORCE++-baseline, Hu 2025; the batch whitening comes later).
    - `group_norm`: (r - mean) / (std + eps), GRPO (Shao et al. 2024, "DeepSeekMath"); std is the sample standard
      deviation of the group (Bessel-corrected, as torch.std and the GRPO reference code). With std_norm=False
      (`--no_advantage_std_norm`) only the mean is subtracted.
    - `dr_grpo`: r - mean, no std division (Liu et al. 2025, "Understanding R1-Zero-Like Training").
    - `rloo`: r_i - mean of the other n-1 rewards = n/(n-1) * (r_i - mean) (Ahmadian et al. 2024, "Back to
      Basics: Revisiting REINFORCE Style Optimization for Learning from Human Feedback in LLMs").
    A group whose rewards are all identical gets exactly 0 (never NaN), whatever the rounding of its mean.
    """
    if method not in GROUP_BASELINES:
        raise ValueError(f"unknown group baseline {method!r}; expected one of {GROUP_BASELINES}")
    n = n_samples_per_prompt
    if n < 2:
        raise ValueError(f"group baseline {method} compares the samples of one prompt: it needs groups of at least "
                         f"2 samples (got n_samples_per_prompt={n})")
    groups = _float(grouped(rewards, n))
    if method == "rloo":
        baseline_of_others = (groups.sum(dim=-1, keepdim=True) - groups) / (n - 1)
        shaped = groups - baseline_of_others
    else:
        shaped = groups - groups.mean(dim=-1, keepdim=True)
        if method == "group_norm" and std_norm:
            shaped = shaped / (groups.std(dim=-1, keepdim=True) + eps)
    constant = (groups.amax(dim=-1, keepdim=True) == groups.amin(dim=-1, keepdim=True))
    return torch.where(constant, torch.zeros((), dtype=shaped.dtype, device=shaped.device), shaped).reshape(-1)


@torch.no_grad()
def compute_advantages(estimator: str, *, rewards: torch.Tensor, action_mask: torch.Tensor,
                       token_kl: torch.Tensor | None = None, values: torch.Tensor | None = None,
                       n_samples_per_prompt: int = 1, gamma: float = 1.0, lambd: float = 0.95,
                       kl_coef: float = 0.0, use_kl_loss: bool = False, std_norm: bool = True,
                       group_eps: float = 1e-6, whiten_eps: float = 1e-8) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages and returns [B, T] for one rollout batch, the way OpenRLHF computes them.

    1. Group baseline on the scalar reward [B] (`reinforce_baseline`, `group_norm`, `dr_grpo`, `rloo`; see
       `group_baseline`, std_norm=False skips the std of group_norm).
    2. Token rewards: the (shaped) scalar reward on the last action token and -kl_coef * token_kl on every action
       token (Ziegler et al. 2019). With use_kl_loss (GRPO style) the KL stays out of the reward and is a loss term
       of the actor instead; token_kl=None also means no penalty.
    3. `gae`: GAE over the critic's values (Schulman et al. 2016), returns = advantages + values.
       Every other estimator: discounted returns of the token rewards, advantages = returns.
    4. `gae`, `reinforce`, `reinforce_baseline`: advantages whitened over every action token of the batch
       (REINFORCE++, Hu 2025; PPO practice); std_norm=False only centres them. `group_norm`, `dr_grpo`, `rloo`
       are already group-relative and are not whitened.
    Returned returns are never whitened (the critic regresses on them for gae).
    """
    if estimator not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {estimator!r}; expected one of {ADVANTAGE_ESTIMATORS}")
    if estimator in GROUP_BASELINES:
        rewards = group_baseline(rewards, n_samples_per_prompt, estimator, std_norm=std_norm, eps=group_eps)
    token_rewards = compute_token_rewards(rewards, token_kl, action_mask, 0.0 if use_kl_loss else kl_coef)
    if estimator == "gae":
        if values is None:
            raise ValueError("gae needs the critic's values (got values=None)")
        advantages, returns = gae_advantages_and_returns(values, token_rewards, action_mask, gamma, lambd)
    else:
        returns = discounted_returns(token_rewards, action_mask, gamma)
        advantages = returns.clone()
    if estimator in BATCH_WHITENED:
        advantages = masked_whiten(advantages, action_mask, divide_std=std_norm, eps=whiten_eps)
    return advantages, returns
