"""Padded and packed batch layouts (docs/CONVENTIONS.md), pair and unpaired batches."""

from __future__ import annotations

import pytest
import torch

from rlhfkit.data.collate import make_collate, pad_collate, pair_collate, unpaired_collate
from rlhfkit.data.packing import pack_collate, unpack_lengths
from rlhfkit.data.preference_dataset import PreferenceDataset, UnpairedDataset

from .conftest import ID

PAD = ID["<pad>"]
SAMPLES = [{"input_ids": [1, 8, 9, 2], "loss_mask": [0, 0, 1, 1]},
           {"input_ids": torch.tensor([1, 14, 2]), "loss_mask": torch.tensor([1, 1, 1])}]


def test_pad_collate_right_pads():
    batch = pad_collate(SAMPLES, PAD)
    assert set(batch) == {"input_ids", "attention_mask", "loss_mask"}
    assert batch["input_ids"].tolist() == [[1, 8, 9, 2], [1, 14, 2, PAD]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 1, 0]]
    assert batch["loss_mask"].tolist() == [[0, 0, 1, 1], [1, 1, 1, 0]]
    assert all(t.dtype == torch.long for t in batch.values())
    assert pad_collate(SAMPLES, PAD, pad_to_multiple=3)["input_ids"].shape == (2, 6)


def test_pack_collate_positions_sample_ids_and_masks():
    batch = pack_collate(SAMPLES, pad_to_multiple=4, pad_id=PAD)
    assert set(batch) == {"input_ids", "position_ids", "sample_ids", "loss_mask"}
    assert batch["input_ids"].tolist() == [[1, 8, 9, 2, 1, 14, 2, PAD]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 2, 0]]
    assert batch["sample_ids"].tolist() == [[0, 0, 0, 0, 1, 1, 1, -1]]
    # the first token of sample 1 is not a target: it would be "predicted" from sample 0's last token
    assert batch["loss_mask"].tolist() == [[0, 0, 1, 1, 0, 1, 1, 0]]
    assert unpack_lengths(batch["sample_ids"]) == [4, 3]
    assert pack_collate(SAMPLES)["input_ids"].shape == (1, 7)
    assert SAMPLES[1]["loss_mask"].tolist() == [1, 1, 1]  # the sample itself is not modified


def test_make_collate_switches_format():
    assert "sample_ids" in make_collate(PAD, packing=True)(SAMPLES)
    assert "attention_mask" in make_collate(PAD)(SAMPLES)


@pytest.fixture
def pairs(tok):
    records = [{"prompt": "hi", "chosen": "hello", "rejected": "bad", "m": 2},
               {"prompt": "how are you", "chosen": "fine thanks", "rejected": "bad", "m": "0.5"}]
    return PreferenceDataset(records, tok, 64, prompt_key="prompt", margin_key="m")


def test_pair_collate_chosen_rows_then_rejected_rows(pairs):
    batch = pair_collate([pairs[0], pairs[1]], PAD)
    p = PAD
    assert batch["input_ids"].tolist() == [[1, 8, 9, 2, p, p, p], [1, 11, 12, 13, 14, 15, 2],
                                           [1, 8, 19, 2, p, p, p], [1, 11, 12, 13, 19, 2, p]]
    assert batch["loss_mask"].tolist() == [[0, 0, 1, 1, 0, 0, 0], [0, 0, 0, 0, 1, 1, 1],
                                           [0, 0, 1, 1, 0, 0, 0], [0, 0, 0, 0, 1, 1, 0]]
    assert batch["attention_mask"].sum(1).tolist() == [4, 7, 4, 6]
    assert batch["margin"].tolist() == [2.0, 0.5]


def test_pair_collate_packed(pairs):
    batch = pair_collate([pairs[0], pairs[1]], PAD, packing=True)
    assert batch["input_ids"].tolist() == [[1, 8, 9, 2, 1, 11, 12, 13, 14, 15, 2, 1, 8, 19, 2, 1, 11, 12, 13, 19, 2]]
    assert unpack_lengths(batch["sample_ids"]) == [4, 7, 4, 6]
    assert batch["loss_mask"].tolist() == [[0, 0, 1, 1, 0, 0, 0, 0, 1, 1, 1, 0, 0, 1, 1, 0, 0, 0, 0, 1, 1]]


def test_unpaired_collate_labels_and_kl_rows(tok):
    records = [{"input": "hi", "output": "hello", "label": True},
               {"input": "how are you", "output": "bad", "label": "false"}]
    ds = UnpairedDataset(records, tok, 64)
    batch = unpaired_collate([ds[0], ds[1]], PAD, kl_rows=True, max_len=64)
    assert batch["labels"].tolist() == [1, 0]
    rows = [row[mask.bool()].tolist() for row, mask in zip(batch["input_ids"], batch["attention_mask"])]
    assert rows == [[1, 8, 9, 2], [1, 11, 12, 13, 19, 2],  # the samples
                    [1, 8, 19, 2], [1, 11, 12, 13, 9, 2]]  # prompt i with the response of sample i-1
    assert batch["loss_mask"][2].tolist()[:4] == [0, 0, 1, 1]
    short = unpaired_collate([ds[0], ds[1]], PAD, kl_rows=True, max_len=5)
    assert short["attention_mask"].sum(1).tolist() == [4, 6, 4, 5]  # only the mismatched rows are cut
