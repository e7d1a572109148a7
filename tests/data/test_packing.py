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
