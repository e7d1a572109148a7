"""Global batches are the same for any world size; micro-batches partition them across ranks."""

from __future__ import annotations

import pytest

from rlhfkit.data.sampler import check_batch_sizes, global_batches, micro_batches_for_rank
from rlhfkit.errors import UserError


def test_global_batches_are_a_seeded_permutation():
    batches = global_batches(50, 16, seed=42, epoch=0)
    assert [len(b) for b in batches] == [16, 16, 16]  # the last 2 samples are dropped
    flat = [i for b in batches for i in b]
    assert len(set(flat)) == 48 and set(flat) <= set(range(50))
    assert global_batches(50, 16, seed=42, epoch=0) == batches
    assert global_batches(50, 16, seed=42, epoch=1) != batches
    assert global_batches(50, 16, seed=41, epoch=1) == global_batches(50, 16, seed=42, epoch=0)  # seed + epoch
    kept = global_batches(50, 16, seed=42, epoch=0, drop_last=False)
    assert [len(b) for b in kept] == [16, 16, 16, 2] and kept[:3] == batches


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_ranks_partition_the_one_rank_micro_batches(world_size):
    for batch in global_batches(64, 16, seed=0, epoch=0):
        one_rank = micro_batches_for_rank(batch, 2, 0, 1)
        assert one_rank == [batch[i:i + 2] for i in range(0, 16, 2)]
        per_rank = [micro_batches_for_rank(batch, 2, r, world_size) for r in range(world_size)]
        assert all(len(m) == 8 // world_size for m in per_rank)  # equal accumulation steps
        union = sorted((mb for m in per_rank for mb in m), key=one_rank.index)
        assert union == one_rank
        assert per_rank[world_size - 1][0] == one_rank[world_size - 1]  # micro-batch k -> rank k % world


def test_divisibility_errors():
    assert check_batch_sizes(16, 2, 4) == 2
    # the flags were checked when parsed (tests/config/test_validate.py); here a bad split is a caller's mistake
    with pytest.raises(ValueError) as e:
        micro_batches_for_rank(list(range(10)), 4, 0, 1)
    assert str(e.value) == "a global batch of 10 samples does not split into micro-batches of 4 over 1 rank(s)"
    with pytest.raises(ValueError, match="a global batch of 16 samples does not split into micro-batches of 4 over 3"):
        check_batch_sizes(16, 4, 3)
    with pytest.raises(UserError, match=r"--train_batch_size 128 is larger than the dataset \(100 samples\)"):
        global_batches(100, 128, seed=0, epoch=0)
