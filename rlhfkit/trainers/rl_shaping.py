"""What the recipes of 2025 do to a rollout batch between scoring and advantages: DAPO's overlong penalty, ProRL's
stop-properly penalty (`shape_rewards`) and the group selection of DAPO's dynamic sampling (`select_groups`).
The math is in `rlhfkit.algorithms.rewards`; this module applies it as the config says and names the metrics.
"""

from __future__ import annotations

import torch

from rlhfkit.algorithms.rewards import groups_in_range, length_penalty, stop_properly_penalty
from rlhfkit.config.rl import PPOConfig, dynamic_filtering_range


def shape_rewards(cfg: PPOConfig, rewards: torch.Tensor, response_lengths: torch.Tensor,
                  truncated: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
    """Rewards [B] with --stop_properly_penalty_coef and then --overlong_buffer_len applied, and their metrics
    (mean penalty over the batch and the fraction of samples each one touched)."""
    rc = cfg.recipe
    metrics: dict[str, float] = {}
    shaped = rewards.float()
    if rc.stop_properly_penalty_coef is not None:
        before = shaped
        shaped = stop_properly_penalty(shaped, truncated, rc.stop_properly_penalty_coef)
        metrics["shaping/stop_properly_penalty"] = float((shaped - before).mean())
        metrics["shaping/stop_properly_fraction"] = float(truncated.float().mean())
    if rc.overlong_buffer_len is not None:
        penalty = length_penalty(response_lengths, cfg.data.generate_max_len, rc.overlong_buffer_len,
                                 rc.overlong_penalty_factor)
        shaped = shaped + penalty
        metrics["shaping/overlong_penalty"] = float(penalty.mean())
        metrics["shaping/overlong_fraction"] = float((penalty < 0).float().mean())
    return shaped, metrics


def select_groups(cfg: PPOConfig, scores: torch.Tensor, wanted: int) -> tuple[list[int], int]:
    """(sample rows of the first `wanted` groups whose mean score is inside --dynamic_filtering_reward_range,
    number of groups that passed). Rows keep a group's samples adjacent, as the group estimators need."""
    n = cfg.rollout.n_samples_per_prompt
    low, high = dynamic_filtering_range(cfg)
    passed = groups_in_range(scores, n, low, high).nonzero().flatten().tolist()
    rows = [g * n + j for g in passed[:wanted] for j in range(n)]
    return rows, len(passed)
