"""Token-budget bin packing: hand-worked plans, and the invariants on random lengths."""

from __future__ import annotations

import random

import pytest

from rlhfkit.data.token_budget import micro_batch_cost, plan_micro_batches, split_over_ranks


def test_first_fit_decreasing_by_hand():
    # Longest first: 8 -> [8]; 5 does not fit (13) -> [5]; 3 -> [5, 3]; 2 -> [8, 2]; 2 -> [5, 3, 2].
    assert plan_micro_batches([5, 3, 8, 2, 2], max_tokens=10) == [[[2, 3], [0, 1, 4]]]


def test_padded_cost_is_rows_times_the_longest_row():
    assert micro_batch_cost([0, 1], [5, 3], widths=[5, 3]) == 10
    assert micro_batch_cost([0, 1], [9, 4], widths=[5, 3], rows_per_sample=2) == 20
    # Padded: 6 and 5 cost 2 x 6 = 12 > 11 apart from packed 11; so two micro-batches, then 1 joins the 5.
    assert plan_micro_batches([6, 5, 1], 11, widths=[6, 5, 1]) == [[[0], [1, 2]]]
    assert plan_micro_batches([6, 5, 1], 11) == [[[0, 1], [2]]]


def test_ranks_are_balanced_and_padded_to_the_same_count():
    # Longest first to the least-loaded rank: 9 -> r0, 4 -> r1, 3 -> r1 (7), 2 -> r1 (9), 1 -> r0 (10).
    assert split_over_ranks([4, 9, 1, 3, 2], 2) == [[1, 2], [0, 3, 4]]
    plan = plan_micro_batches([4, 9, 1, 3, 2], max_tokens=9, world_size=2)
    assert plan == [[[1], [2]], [[0, 3, 4], []]]
    # Fewer samples than ranks: every rank still runs one (empty) micro-batch.
    assert plan_micro_batches([3], 5, world_size=3) == [[[0]], [[]], [[]]]


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("padded", [False, True])
def test_random_plans_cover_every_sample_once_within_budget(world_size, padded):
    rng = random.Random(world_size * 2 + padded)
    for _ in range(30):
        lengths = [rng.choice([1, 2, 3, 50, 120]) + rng.randrange(5) for _ in range(rng.randrange(1, 40))]
        widths = lengths if padded else None
        budget = max(lengths) + rng.randrange(200)
        plan = plan_micro_batches(lengths, budget, world_size, widths=widths)
        assert len(plan) == world_size and len({len(p) for p in plan}) == 1
        flat = sorted(i for rank in plan for mb in rank for i in mb)
        assert flat == list(range(len(lengths)))
        assert all(micro_batch_cost(mb, lengths, widths) <= budget for rank in plan for mb in rank)
        assert plan == plan_micro_batches(lengths, budget, world_size, widths=widths)  # deterministic


def test_a_sample_over_the_budget_is_a_value_error():
    with pytest.raises(ValueError, match="more than the budget"):
        plan_micro_batches([3, 12], max_tokens=10)
    with pytest.raises(ValueError, match="more than the budget"):
        plan_micro_batches([4], max_tokens=7, widths=[4], rows_per_sample=2)
    with pytest.raises(ValueError, match="positive"):
        plan_micro_batches([1], max_tokens=0)
