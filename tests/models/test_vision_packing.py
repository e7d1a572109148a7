"""Packed rows with images on the tiny Qwen2-VL (`--packing_samples --image_key`): a packed row carries its samples'
images in row order, and the model's forward hook gives each sample the M-RoPE positions the padded forward gives
it (rlhfkit/models/vision.py), so SFT loss and gradients, DPO sequence log-probs and RL action log-probs of a
packed batch equal the padded batch's to 1e-5 (fp32). The samples differ in length, in their number of images
(0, 1, 2) and in the images' shapes (square, wide, tall: other M-RoPE grids)."""

from __future__ import annotations

import io

import pytest
import torch

from rlhfkit.algorithms.sft_loss import sft_loss
from rlhfkit.data.collate import make_collate, pair_collate
from rlhfkit.data.images import RecordImages
from rlhfkit.data.readers import Record
from rlhfkit.data.sft_dataset import SFTDataset
from rlhfkit.data.token_budget import plan_micro_batches
from rlhfkit.models.loading import load_causal_lm, load_tokenizer
from rlhfkit.models.policy import forward_logits, packed_attention_mask
from rlhfkit.models.vision import image_runs, packed_multimodal_positions, vision_tokens

SIDE = 56  # the tiny model's image side: 4 x 4 patches of 14 pixels, 2 x 2 merged into 4 vision tokens


def png(width: int, height: int, colour: tuple[int, int, int]) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (width, height), colour).save(out, format="PNG")
    return out.getvalue()


@pytest.fixture(scope="module")
def vlm(vlm_assets):
    """(model, tokenizer, 3 SFT samples: one square image, a wide and a tall image, none)."""
    from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

    path = str(vlm_assets.model_dir)
    model, tokenizer = load_causal_lm(path).eval(), load_tokenizer(path)
    # images keep their shape (up to 4x the tiny model's area): a 112 x 56 image is 8 x 4 patches, 4 x 2 tokens
    processor = Qwen2VLImageProcessorPil(min_pixels=SIDE * SIDE, max_pixels=4 * SIDE * SIDE, patch_size=14,
                                         merge_size=2, temporal_patch_size=2)
    images = RecordImages(vision_tokens(model.config, tokenizer), processor, "images", 2)
    records = [Record({"prompt": "How many dots are there?", "answer": "3", "images": [png(SIDE, SIDE, (9, 9, 9))]}),
               Record({"prompt": "Which is wider, <image> or <image>? Say which one.", "answer": "the first one",
                       "images": [png(2 * SIDE, SIDE, (200, 0, 0)), png(SIDE, 2 * SIDE, (0, 0, 200))]}),
               Record({"prompt": "Say yes.", "answer": "yes yes"})]
    samples = list(SFTDataset(records, tokenizer, 128, input_key="prompt", output_key="answer",
                              apply_chat_template=True, images=images))
    return model, tokenizer, samples


def test_samples_differ_in_length_images_and_grids(vlm):
    model, _, samples = vlm
    grids = [s["image_grid_thw"].tolist() if "image_grid_thw" in s else [] for s in samples]
    assert grids == [[[1, 4, 4]], [[1, 4, 8], [1, 8, 4]], []]
    assert len({len(s["input_ids"]) for s in samples}) == 3
    is_image = torch.stack([s["input_ids"] == model.config.image_token_id for s in samples[1:2]])[0]
    assert int(is_image.sum()) == 16 and image_runs(is_image) == 2


def test_packed_positions_restart_per_sample_as_the_padded_forward_computes_them(vlm):
    model, tokenizer, samples = vlm
    padded = make_collate(tokenizer.pad_token_id)(samples)
    packed = make_collate(tokenizer.pad_token_id, packing=True, pad_to_multiple=8)(samples)
    assert torch.equal(packed["pixel_values"], padded["pixel_values"])  # images in row order
    ids, mask = padded["input_ids"], padded["attention_mask"]
    expected, _ = model.model.get_rope_index(ids, (ids == model.config.image_token_id).int(),
                                             image_grid_thw=padded["image_grid_thw"], attention_mask=mask)
    positions = packed_multimodal_positions(model, packed["input_ids"], packed["position_ids"],
                                            packed["image_grid_thw"])
    assert positions.shape == (4, 1, packed["input_ids"].shape[1])
    assert torch.equal(positions[0], packed["position_ids"])  # the text positions, for flash-attention's boundaries
    for i in range(len(samples)):
        where = packed["sample_ids"][0] == i
        assert torch.equal(positions[1:, 0, where], expected[:, i, mask[i].bool()]), i
    # an image's tokens share a temporal position and span its grid: the wide image's 2 x 4 tokens after "<image>"
    wide = positions[1:, 0, (packed["sample_ids"][0] == 1) & (packed["input_ids"][0] == model.config.image_token_id)]
    assert wide[:, :8].sub(wide[:, :1]).tolist() == [[0] * 8, [0, 0, 0, 0, 1, 1, 1, 1], [0, 1, 2, 3, 0, 1, 2, 3]]
    with pytest.raises(ValueError, match="hold 3 images but image_grid_thw has 2"):
        packed_multimodal_positions(model, packed["input_ids"], packed["position_ids"], packed["image_grid_thw"][:2])
    with pytest.raises(ValueError, match="start at 0"):
        packed_multimodal_positions(model, packed["input_ids"], packed["position_ids"] + 1, packed["image_grid_thw"])


def test_packed_sft_loss_and_gradients_equal_the_padded_batch(vlm):
    model, tokenizer, samples = vlm
    targets = sum(int(s["loss_mask"][1:].sum()) for s in samples)
    results = []
    for packing in (False, True):
        batch = make_collate(tokenizer.pad_token_id, packing=packing)(samples)
        model.zero_grad()
        loss = sft_loss(forward_logits(model, batch), batch["input_ids"], batch["loss_mask"],
                        sample_ids=batch.get("sample_ids"), num_tokens=targets)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((float(loss.detach()), grads))
    (padded, grads), (packed, packed_grads) = results
    assert abs(padded - packed) < 1e-5, (padded, packed)
    assert grads.keys() == packed_grads.keys() and any("visual" in n for n in grads)
    gap = max(float((grads[n] - packed_grads[n]).abs().max()) for n in grads)
    assert gap < 1e-5, gap
    # the positions matter: the same packed row with plain text positions gives another loss
    batch = make_collate(tokenizer.pad_token_id, packing=True)(samples)
    with torch.no_grad():
        flat = model(input_ids=batch["input_ids"], pixel_values=batch["pixel_values"],
                     image_grid_thw=batch["image_grid_thw"], position_ids=batch["position_ids"][None].expand(3, 1, -1),
                     attention_mask=packed_attention_mask(batch["sample_ids"], torch.float32)).logits
    wrong = sft_loss(flat, batch["input_ids"], batch["loss_mask"], sample_ids=batch["sample_ids"], num_tokens=targets)
    assert abs(float(wrong) - packed) > 1e-4
    model.zero_grad()


def test_packed_dpo_pairs_give_the_padded_sequence_logps(vlm):
    from rlhfkit.trainers.preference import sequence_logps

    model, tokenizer, samples = vlm
    pairs = []
    for s in samples:
        start = int(s["loss_mask"].nonzero()[0])  # the answer's first token
        extra = {k: s[k] for k in ("pixel_values", "image_grid_thw") if k in s}
        pairs.append({"prompt_ids": s["input_ids"][:start], "chosen_ids": s["input_ids"][start:],
                      "rejected_ids": s["input_ids"][start:].flip(0), **extra})
    with torch.no_grad():
        padded = sequence_logps(model, pair_collate(pairs, tokenizer.pad_token_id))
        packed = sequence_logps(model, pair_collate(pairs, tokenizer.pad_token_id, packing=True))
    assert torch.equal(padded[1], packed[1])  # the same response tokens
    assert (padded[0] - packed[0]).abs().max() < 1e-5


def test_packed_rl_action_log_probs_equal_the_padded_forward(vlm):
    from rlhfkit.rl.experience import experience_from_samples
    from rlhfkit.rl.role_forward import action_log_probs
    from rlhfkit.rollout.engine import SampledSequence

    model, tokenizer, samples = vlm
    rows, images = [], []
    for s in samples:
        start = int(s["loss_mask"].nonzero()[0])
        ids = s["input_ids"].tolist()
        rows.append(SampledSequence(ids[:start], ids[start:], [0.0] * (len(ids) - start), "stop"))
        images.append({k: s[k] for k in ("pixel_values", "image_grid_thw")} if "pixel_values" in s else None)
    exp = experience_from_samples(rows, tokenizer.pad_token_id, images)
    with torch.no_grad():
        padded = action_log_probs(model, exp, temperature=1.0)
        packed = action_log_probs(model, exp, temperature=1.0, packed=True)
    mask = exp.action_mask
    assert (padded - packed).abs()[mask].max() < 1e-5


def test_token_budgets_count_vision_tokens(vlm):
    """A sample's length, which --use_dynamic_batch's budget and packing count, holds each image's vision tokens
    (its grid's patches over the 2 x 2 merge), beside the text."""
    model, tokenizer, samples = vlm
    vision = [int((s["input_ids"] == model.config.image_token_id).sum()) for s in samples]
    assert vision == [4, 16, 0]
    assert vision == [int(s["image_grid_thw"].prod(-1).sum()) // 4 if "image_grid_thw" in s else 0 for s in samples]
    lengths = [len(s["input_ids"]) for s in samples]
    packed = make_collate(tokenizer.pad_token_id, packing=True)(samples)
    assert packed["input_ids"].shape[1] == sum(lengths)
    # a packed budget one token short of the three samples splits them, though their text alone would fit
    assert len(plan_micro_batches(lengths, max_tokens=sum(lengths))[0]) == 1
    assert len(plan_micro_batches(lengths, max_tokens=sum(lengths) - 1)[0]) == 2 and sum(vision) > 1
