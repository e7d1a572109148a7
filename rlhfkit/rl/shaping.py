"""What the recipes of 2025 do to a rollout batch between scoring and advantages: DAPO's overlong penalty, ProRL's
stop-properly penalty (`shape_rewards`) and DAPO's dynamic sampling (`select_groups`, `fill_filtered_batch`).
The math is in `rlhfkit.algorithms.rewards`; this module applies it as the config says and names the metrics.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from rlhfkit.algorithms.rewards import groups_in_range, length_penalty, stop_properly_penalty
from rlhfkit.config.rl import PPOConfig, dynamic_filtering_range
from rlhfkit.errors import UserError
from rlhfkit.rl.experience import Experience


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


def fill_filtered_batch(cfg: PPOConfig, exp: Experience, texts: dict[str, Any], reward: dict[str, Any],
                        generate: Callable[[int], tuple[Experience, dict[str, Any], dict[str, Any]] | None]
                        ) -> tuple[Experience, dict[str, Any], dict[str, Any], dict[str, float]]:
    """DAPO's dynamic sampling over generation rounds: keep the groups of the scored batch (exp, texts, reward)
    that pass `select_groups`, and call `generate(round)` (the next prompts of the stream, generated and scored;
    None when the data is used up) until --rollout_batch_size groups are kept, at most
    --dynamic_filtering_max_rounds rounds (else UserError). Returns the kept batch and its metrics."""
    n, wanted = cfg.rollout.n_samples_per_prompt, cfg.rollout.rollout_batch_size
    parts: list[tuple[Experience, dict[str, list], dict[str, Any]]] = []
    kept = passed = seen = 0
    for round_ in range(1, cfg.recipe.dynamic_filtering_max_rounds + 1):
        rows, passing = select_groups(cfg, reward["scores"], wanted - kept)
        seen += len(reward["scores"]) // n
        passed += passing
        if rows:
            # per-sample lists only: an agent's episode_reward dict was consumed when scoring
            parts.append((exp.select(rows), {k: [v[i] for i in rows] for k, v in texts.items() if isinstance(v, list)},
                          {"rewards": reward["rewards"][rows], "scores": reward["scores"][rows],
                           "extra_logs": reward["extra_logs"], "metrics": reward.get("metrics", {})}))
            kept += len(rows) // n
        if kept == wanted:
            break
        if round_ == cfg.recipe.dynamic_filtering_max_rounds:
            raise UserError(f"--dynamic_filtering: only {kept} of --rollout_batch_size {wanted} groups had a mean "
                            "score inside --dynamic_filtering_reward_range "
                            f"{cfg.recipe.dynamic_filtering_reward_range} after {round_} generation rounds "
                            "(--dynamic_filtering_max_rounds); raise the cap, widen the range, or use prompts the "
                            "policy neither always solves nor always fails")
        more = generate(round_)
        if more is None:
            raise UserError(f"--dynamic_filtering: the prompt data ran out (--num_episodes "
                            f"{cfg.rollout.num_episodes}) with only {kept} of {wanted} groups of this step kept; add "
                            "prompts or episodes, or widen --dynamic_filtering_reward_range")
        exp, texts, reward = more
    batch = Experience.concat([p[0] for p in parts])
    batch_texts = {k: [x for p in parts for x in p[1][k]] for k in parts[0][1]}
    batch_reward = {"rewards": torch.cat([p[2]["rewards"] for p in parts]),
                    "scores": torch.cat([p[2]["scores"] for p in parts]),
                    "extra_logs": parts[-1][2]["extra_logs"], "metrics": parts[-1][2]["metrics"]}
    return batch, batch_texts, batch_reward, {"dynamic_filtering/pass_rate": passed / max(seen, 1),
                                              "dynamic_filtering/rounds": float(round_)}
