"""fill_filtered_batch (DAPO's dynamic sampling over generation rounds) on scripted scores, without a model; and
shape_rewards applying both penalties as the config says."""

from __future__ import annotations

import pytest
import torch

from rlhfkit.config.rl import PPOConfig
from rlhfkit.errors import UserError
from rlhfkit.rl.experience import Experience
from rlhfkit.rl.shaping import fill_filtered_batch, shape_rewards


def config(max_rounds: int = 8) -> PPOConfig:
    cfg = PPOConfig()
    cfg.rollout.n_samples_per_prompt, cfg.rollout.rollout_batch_size = 2, 3
    cfg.recipe.dynamic_filtering, cfg.recipe.dynamic_filtering_max_rounds = True, max_rounds
    return cfg


def scored(scores: list[float], first_id: int):
    """A batch whose sample i has sequence id first_id + i (to see which rows were kept) and the given scores."""
    b = len(scores)
    ids = torch.arange(first_id, first_id + b)[:, None].repeat(1, 3)
    exp = Experience(sequences=ids, attention_mask=torch.ones(b, 3, dtype=torch.long),
                     prompt_lengths=torch.ones(b, dtype=torch.long), action_mask=torch.ones(b, 2))
    t = torch.tensor(scores)
    return exp, {"prompts": [f"p{first_id + i}" for i in range(b)]}, {"rewards": t, "scores": t, "extra_logs": {}}


# rounds of 3 groups x 2 samples: (1,1) and (0,0) groups are dropped, mixed ones kept
ROUNDS = [[1, 1, 0, 1, 0, 0], [0, 0, 1, 1, 1, 1], [1, 0, 0, 1, 0, 1]]


def test_keeps_exactly_the_mixed_groups_and_fills_the_batch():
    calls = []

    def generate(round_):
        calls.append(round_)
        return scored(ROUNDS[round_], 100 * round_)

    exp, texts, reward, metrics = fill_filtered_batch(config(), *scored(ROUNDS[0], 0), generate)
    # round 0 keeps group 1 (ids 2, 3); round 1 none; round 2 keeps its first two groups, the third is surplus
    assert exp.sequences[:, 0].tolist() == [2, 3, 200, 201, 202, 203]
    assert texts["prompts"] == ["p2", "p3", "p200", "p201", "p202", "p203"]
    assert reward["scores"].tolist() == [0, 1, 1, 0, 0, 1]
    assert calls == [1, 2]
    assert metrics == {"dynamic_filtering/pass_rate": 4 / 9, "dynamic_filtering/rounds": 3.0}


def test_round_cap_and_exhausted_data_stop_with_a_message():
    with pytest.raises(UserError, match="only 1 of --rollout_batch_size 3 groups .* after 2 generation rounds"):
        fill_filtered_batch(config(max_rounds=2), *scored(ROUNDS[0], 0),
                            lambda r: scored(ROUNDS[r], 100 * r))
    with pytest.raises(UserError, match="the prompt data ran out"):
        fill_filtered_batch(config(), *scored(ROUNDS[0], 0), lambda r: None)


def test_shape_rewards_applies_stop_properly_then_overlong():
    cfg = PPOConfig()
    cfg.data.generate_max_len, cfg.recipe.overlong_buffer_len, cfg.recipe.overlong_penalty_factor = 10, 4, 0.5
    cfg.recipe.stop_properly_penalty_coef = 0.0
    rewards = torch.tensor([1.0, 1.0, 1.0])
    shaped, metrics = shape_rewards(cfg, rewards, torch.tensor([3, 8, 10]), torch.tensor([0.0, 0.0, 1.0]))
    # 8 tokens: (6 - 8) / 4 * 0.5 = -0.25; 10 tokens truncated: 1 * 0 then -0.5
    torch.testing.assert_close(shaped, torch.tensor([1.0, 0.75, -0.5]))
    assert metrics["shaping/overlong_fraction"] == pytest.approx(2 / 3)
    assert metrics["shaping/stop_properly_penalty"] == pytest.approx(-1 / 3)
