"""Reward shaping: clipping, normalisation with a reward model's statistics, DAPO's overlong penalty, ProRL's
stop-properly penalty, the per-token reward with a KL penalty, and the group filter of dynamic sampling.

Scalar rewards are [B] (one per sample); token tensors are [B, T] aligned with the action mask.
"""

from __future__ import annotations

import torch


def clip_rewards(rewards: torch.Tensor, clip_range: float) -> torch.Tensor:
    """Clamp rewards to [-clip_range, clip_range] (`--reward_clip_range`; Ziegler et al. 2019 style shaping)."""
    if clip_range <= 0:
        raise ValueError(f"clip_range must be > 0 (got {clip_range})")
    return rewards.clamp(-clip_range, clip_range)


def normalize_rewards(rewards: torch.Tensor, mean: float | torch.Tensor, std: float | torch.Tensor,
                      eps: float = 1e-8) -> torch.Tensor:
    """(r - mean) / std with the reward model's stored statistics (`--normalize_reward`).

    The statistics are those a reward model records over its training data (Ouyang et al. 2022, InstructGPT,
    normalise the RM so that demonstrations score 0 on average). std is floored at eps.
    """
    mean = torch.as_tensor(mean, dtype=rewards.dtype, device=rewards.device)
    std = torch.as_tensor(std, dtype=rewards.dtype, device=rewards.device)
    return (rewards - mean) / std.clamp(min=eps)


def length_penalty(response_lengths: torch.Tensor, max_len: int, buffer_len: int,
                   penalty_factor: float = 1.0) -> torch.Tensor:
    """Soft overlong punishment of DAPO (Yu et al. 2025), to be added to the reward.

    With L the response length, L_max = max_len and L_cache = buffer_len:
        0                                   if L <= L_max - L_cache
        ((L_max - L_cache) - L) / L_cache   if L_max - L_cache < L <= L_max   (linear from 0 to -1)
        -1                                  if L > L_max
    all multiplied by penalty_factor. Returns float32 [B].
    """
    if not 0 < buffer_len <= max_len:
        raise ValueError(f"overlong buffer length must be in (0, max_len={max_len}] (got {buffer_len})")
    lengths = response_lengths.to(torch.float32)
    expected = max_len - buffer_len
    penalty = ((expected - lengths) / buffer_len).clamp(min=-1.0, max=0.0)
    return penalty * penalty_factor


def stop_properly_penalty(rewards: torch.Tensor, truncated: torch.Tensor, coef: float) -> torch.Tensor:
    """ProRL's penalty on responses that did not stop properly (Liu et al. 2025, "ProRL: Prolonged Reinforcement
    Learning Expands Reasoning Boundaries in Large Language Models"; ProRL v2), OpenRLHF's and NeMo-RL's definition:
    a truncated response (no end of sequence within the length limit) gets reward * coef if coef >= 0 (coef in
    [0, 1]; 0 zeroes it) and the reward coef if coef < 0. Other responses keep theirs. Returns rewards' dtype [B].
    """
    if coef > 1:
        raise ValueError(f"the stop-properly coef must be <= 1 (got {coef})")
    shaped = rewards * coef if coef >= 0 else torch.full_like(rewards, coef)
    return torch.where(truncated.bool(), shaped, rewards)


def last_action_index(action_mask: torch.Tensor) -> torch.Tensor:
    """Index [B] of the last position where the action mask is 1 (0 for a row without actions)."""
    positions = torch.arange(action_mask.shape[-1], device=action_mask.device)
    return torch.where(action_mask.bool(), positions, -1).amax(dim=-1).clamp(min=0)


def compute_token_rewards(final_reward: torch.Tensor, kl: torch.Tensor | None, action_mask: torch.Tensor,
                          kl_coef: float = 0.0) -> torch.Tensor:
    """Per-token rewards [B, T]: -kl_coef * kl on every action token, plus the scalar reward on the last one.

    This is the KL-shaped reward of Ziegler et al. 2019 ("Fine-Tuning Language Models from Human Preferences"),
    r_t = -beta * KL_t + [t == last] * R, as used by OpenRLHF. The last action token is the last position where
    the mask is 1, so masks with holes (tool or environment tokens in multi-turn rollouts) work. Positions outside
    the mask are 0. kl may be None (no penalty).
    """
    dtype = torch.promote_types(final_reward.dtype, torch.float32)
    mask = action_mask.bool()
    if kl is None or kl_coef == 0:
        token_rewards = torch.zeros(action_mask.shape, dtype=dtype, device=action_mask.device)
    else:
        token_rewards = torch.where(mask, -kl_coef * kl.to(dtype), torch.zeros((), dtype=dtype,
                                                                                device=action_mask.device))
    last = last_action_index(action_mask)
    has_action = mask.any(dim=-1)
    reward_at_last = torch.where(has_action, final_reward.to(dtype), torch.zeros((), dtype=dtype,
                                                                                   device=action_mask.device))
    return token_rewards.scatter_add(-1, last[:, None], reward_at_last[:, None])


def grouped(rewards: torch.Tensor, n_samples_per_prompt: int) -> torch.Tensor:
    """View rewards [num_prompts * n] as [num_prompts, n] (samples of one prompt are contiguous)."""
    n = n_samples_per_prompt
    if rewards.dim() != 1 or n < 1 or rewards.numel() % n != 0:
        raise ValueError(f"rewards of shape {tuple(rewards.shape)} cannot be split into groups of "
                         f"n_samples_per_prompt={n}; the rollout batch must hold whole groups")
    return rewards.reshape(-1, n)


def groups_in_range(scores: torch.Tensor, n_samples_per_prompt: int, low: float, high: float) -> torch.Tensor:
    """Bool [num_prompts]: True where the mean score of a prompt's group lies strictly inside (low, high).

    The filter of DAPO's dynamic sampling (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System
    at Scale"): with 0/1 scores and (0, 1), a group that is all correct or all wrong has the same reward everywhere,
    hence zero group-relative advantage and no gradient, so it is dropped and replaced. Samples of one prompt are
    contiguous in scores [num_prompts * n].
    """
    if not low < high:
        raise ValueError(f"dynamic filtering range needs low < high (got {low}, {high})")
    means = grouped(scores, n_samples_per_prompt).double().mean(dim=-1)
    return (means > low) & (means < high)
