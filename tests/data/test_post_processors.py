"""Post-processors of batch_inference on hand-made scored samples, checked against hand-computed results."""

from __future__ import annotations

import math

import pytest

from rlhfkit.data.post_processors import (
    conditional_sft,
    dpo_pairs,
    edit_prompt,
    normalize_rewards,
    quantile_buckets,
    rejection_sampling,
)

MSGS = [{"role": "user", "content": "hi"}]
SAMPLES = [
    {"input": "a", "output": "a1", "reward": 0.5},
    {"input": "b", "output": "b1", "reward": 2.0},
    {"input": "a", "output": "a2", "reward": 1.5},
    {"input": "a", "output": "a3", "reward": -1.0},
    {"input": "b", "output": "b2", "reward": 2.0},  # ties b1: prompt b gives no DPO pair
    {"input": MSGS, "output": "m1", "reward": 0.0},
    {"input": [dict(MSGS[0])], "output": "m2", "reward": 3.0},  # an equal message list is the same prompt
]


def test_rejection_sampling_keeps_each_prompts_best_in_first_seen_order():
    assert rejection_sampling(SAMPLES) == [
        {"input": "a", "output": "a2", "reward": 1.5},
        {"input": "b", "output": "b1", "reward": 2.0},  # first of equal rewards
        {"input": MSGS, "output": "m2", "reward": 3.0},
    ]


def test_dpo_pairs_best_vs_worst_and_ties_dropped():
    pairs, dropped = dpo_pairs(SAMPLES)
    assert dropped == 1
    assert pairs == [
        {"prompt": "a", "chosen": "a2", "rejected": "a3", "chosen_reward": 1.5, "rejected_reward": -1.0},
        {"prompt": MSGS, "chosen": "m2", "rejected": "m1", "chosen_reward": 3.0, "rejected_reward": 0.0},
    ]


def test_normalize_rewards_is_a_z_score_with_n_minus_1():
    # mean 2, deviations -1, 0, 1 -> var (1 + 0 + 1) / 2 = 1
    assert normalize_rewards([1.0, 2.0, 3.0]) == [-1.0, 0.0, 1.0]
    assert normalize_rewards([4.0, 4.0]) == [0.0, 0.0]  # no spread: only the mean is removed
    z = normalize_rewards([0.0, 10.0])
    assert z == pytest.approx([-5 / math.sqrt(50), 5 / math.sqrt(50)])


def test_quantile_buckets_by_rank_with_ties_sharing():
    # n = 5: lower counts 0, 1, 1, 3, 4 -> 1 + floor(2 * c / 5) = 1, 1, 1, 2, 2
    assert quantile_buckets([0.1, 0.5, 0.5, 0.9, 1.0], 2) == [1, 1, 1, 2, 2]
    assert quantile_buckets([3.0, 1.0, 2.0, 4.0], 4) == [3, 1, 2, 4]
    with pytest.raises(ValueError):
        quantile_buckets([1.0], 0)


def test_conditional_sft_writes_score_or_bucket_into_the_prompt():
    out = conditional_sft(SAMPLES[:3], "{input} <rm_score>: {reward} ")
    assert [r["input"] for r in out] == ["a <rm_score>: 0.50 ", "b <rm_score>: 2.00 ", "a <rm_score>: 1.50 "]
    assert [r["output"] for r in out] == ["a1", "b1", "a2"]
    buckets = conditional_sft(SAMPLES[:3], "[{reward}] {input}", num_buckets=3)
    assert [r["input"] for r in buckets] == ["[1] a", "[3] b", "[2] a"]
    messages = conditional_sft(SAMPLES[5:6], "{input} <rm_score>: {reward} ")
    assert messages[0]["input"] == [{"role": "user", "content": "hi <rm_score>: 0.00 "}]
    assert MSGS == [{"role": "user", "content": "hi"}]  # the sample's own messages are not changed


def test_edit_prompt_needs_a_user_message():
    with pytest.raises(ValueError):
        edit_prompt([{"role": "system", "content": "x"}], str.upper)
