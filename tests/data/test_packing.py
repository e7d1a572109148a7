"""pack_padded / packed_index: padded RL rows as one packed row, and the way back (hand-written expectations)."""

from __future__ import annotations

import torch

from rlhfkit.data.packing import pack_padded, packed_index, unpack_lengths


def test_pack_padded_keeps_real_tokens_and_restarts_positions():
    ids = torch.tensor([[5, 6, 7, 0], [8, 0, 0, 0], [9, 10, 11, 12]])
    mask = (ids != 0).long()
    batch, offsets = pack_padded(ids, mask)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9, 10, 11, 12]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 0, 1, 2, 3]]
    assert batch["sample_ids"].tolist() == [[0, 0, 0, 1, 2, 2, 2, 2]]
    assert offsets.tolist() == [0, 3, 4]
    assert unpack_lengths(batch["sample_ids"]) == [3, 1, 4]
    # Padded position (row, t) -> packed position; positions past a row's end stay inside that row.
    positions = torch.tensor([[1, 2, 3], [0, 1, 2], [1, 2, 3]])
    assert packed_index(offsets, positions, mask.sum(dim=1)).tolist() == [[1, 2, 2], [3, 3, 3], [5, 6, 7]]


def test_pack_rows_lays_a_padded_batch_into_fewer_rows():
    from rlhfkit.data.packing import pack_rows

    # lengths 4, 1, 1, 2 in width 4: first-fit decreasing gives [sample 0] and [sample 3, sample 1, sample 2]
    ids = torch.tensor([[1, 2, 3, 4], [5, 0, 0, 0], [6, 0, 0, 0], [7, 8, 0, 0]])
    batch = {"input_ids": ids, "attention_mask": (ids != 0).long(), "loss_mask": (ids != 0).long()}
    out = pack_rows(batch)
    assert out["input_ids"].tolist() == [[1, 2, 3, 4], [7, 8, 5, 6]]
    assert out["sample_ids"].tolist() == [[0, 0, 0, 0], [3, 3, 1, 2]]
    assert out["position_ids"].tolist() == [[0, 1, 2, 3], [0, 1, 0, 0]]
    assert out["loss_mask"].tolist() == [[0, 1, 1, 1], [0, 1, 0, 0]]  # a sample's first token is never a target
    # a row wider than the batch when that needs fewer token slots (9 in one row of 9, not 12 in 4 rows of 3)
    ids = torch.tensor([[1, 2, 3], [4, 5, 0], [6, 7, 0], [8, 9, 0]])
    out = pack_rows({"input_ids": ids, "attention_mask": (ids != 0).long(), "loss_mask": (ids != 0).long()})
    assert out["sample_ids"].tolist() == [[0, 0, 0, 1, 1, 2, 2, 3, 3]]
    assert out["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1, 0, 1]]
    # long rows: attention makes one row of 1210 dearer than two of 610 (600 + 10, then 600 + 10 padding with
    # sample id -1, positions from 0 and no loss)
    mask = torch.ones(3, 600, dtype=torch.long)
    mask[2, 10:] = 0
    out = pack_rows({"input_ids": mask * 7, "attention_mask": mask, "loss_mask": mask})
    assert out["sample_ids"].shape == (2, 610)
    assert out["sample_ids"][0].tolist() == [0] * 600 + [2] * 10
    assert out["sample_ids"][1].tolist() == [1] * 600 + [-1] * 10
    assert out["position_ids"][1, 600:].tolist() == list(range(10))
    assert int(out["loss_mask"][1, 600:].sum()) == 0 and int(out["input_ids"][1, 600:].sum()) == 0


def test_pack_rows_leaves_full_or_left_padded_batches():
    from rlhfkit.data.packing import pack_rows

    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    assert pack_rows({"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": ids}) is None
    left = torch.tensor([[0, 1], [0, 1], [1, 1]])
    assert pack_rows({"input_ids": ids[:, :2].repeat(2, 1)[:3], "attention_mask": left, "loss_mask": left}) is None
