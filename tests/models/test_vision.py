"""The tiny Qwen2-VL through rlhfkit's forward paths (rlhfkit/models/vision.py, policy.py): log-probs with pixel
inputs and M-RoPE positions agree with an independent float64 forward and do not depend on batch mates, a token-budget
split of a batch with images gives the padded batch's SFT loss, and --freeze_visual_encoder trains the language
model only."""

from __future__ import annotations

import pytest
import torch

from rlhfkit.algorithms.sft_loss import sft_loss, token_logprobs
from rlhfkit.data.collate import make_collate
from rlhfkit.data.readers import load_mixture
from rlhfkit.data.sft_dataset import SFTDataset
from rlhfkit.data.token_budget import plan_micro_batches
from rlhfkit.models.loading import load_causal_lm, load_model_config, load_tokenizer
from rlhfkit.models.policy import forward_logits, sequence_token_logprobs
from rlhfkit.models.vision import freeze_visual_encoder, record_images, vision_parameter_names


@pytest.fixture(scope="module")
def vlm(vlm_assets):
    """(model, tokenizer, 6 SFT samples with one image each)."""
    path = str(vlm_assets.model_dir)
    model, tokenizer = load_causal_lm(path), load_tokenizer(path)
    images = record_images(load_model_config(path), path, tokenizer, "images", 1)
    records = load_mixture(str(vlm_assets.split("sft_train")), None, "train", 6, 0, arg_name="--dataset")
    samples = SFTDataset(records, tokenizer, 64, input_key="prompt", output_key="answer", apply_chat_template=True,
                         images=images)
    return model, tokenizer, samples


def test_each_image_is_four_vision_tokens_outside_the_loss(vlm):
    model, _, samples = vlm
    image_token = model.config.image_token_id
    for s in samples:
        vision = s["input_ids"] == image_token
        assert int(vision.sum()) == 4 and not bool(s["loss_mask"][vision].any())
        assert s["pixel_values"].shape == (16, 3 * 2 * 14 * 14) and s["image_grid_thw"].tolist() == [[1, 4, 4]]


def test_logprobs_match_a_float64_forward_and_do_not_depend_on_batch_mates(vlm):
    model, tokenizer, samples = vlm
    collate = make_collate(tokenizer.pad_token_id)
    batch = collate(list(samples)[:4])
    with torch.no_grad():
        together = sequence_token_logprobs(model, batch)
        reference = torch.nn.Module.double(load_causal_lm(str(model.name_or_path)))
        for i in range(4):
            one = collate([samples[i]])
            n = one["input_ids"].shape[1]
            alone = sequence_token_logprobs(model, one)
            assert torch.allclose(together[i, :n - 1], alone[0], atol=1e-5)
            # independent: float64, HF's own forward with the processor-style mm_token_type_ids given explicitly
            logits = reference(input_ids=one["input_ids"], attention_mask=one["attention_mask"],
                               pixel_values=one["pixel_values"].double(), image_grid_thw=one["image_grid_thw"],
                               mm_token_type_ids=(one["input_ids"] == model.config.image_token_id).int()).logits
            exact = token_logprobs(logits[:, :-1], one["input_ids"][:, 1:])
            assert (alone.double() - exact).abs().max() < 1e-4


def test_images_and_mrope_positions_change_the_logprobs(vlm):
    model, tokenizer, samples = vlm
    one = make_collate(tokenizer.pad_token_id)([samples[0]])
    with torch.no_grad():
        base = forward_logits(model, one)
        other = forward_logits(model, dict(one, pixel_values=torch.zeros_like(one["pixel_values"])))
        flat = model(input_ids=one["input_ids"], attention_mask=one["attention_mask"],
                     pixel_values=one["pixel_values"], image_grid_thw=one["image_grid_thw"],
                     position_ids=torch.arange(one["input_ids"].shape[1]).expand(3, 1, -1)).logits  # 2-D: packed
    assert (base - other).abs().max() > 1e-4  # the image is read
    assert (base - flat).abs().max() > 1e-4  # positions are M-RoPE's, not 0..T-1
    image_tokens = (one["input_ids"] == model.config.image_token_id).int()
    _, rope_deltas = model.model.get_rope_index(one["input_ids"], image_grid_thw=one["image_grid_thw"],
                                                mm_token_type_ids=image_tokens)
    assert rope_deltas.tolist() == [[-2]]  # a 2 x 2 image spans 2 positions, not 4


def test_a_token_budget_split_gives_the_padded_batch_loss(vlm):
    model, tokenizer, samples = vlm
    collate = make_collate(tokenizer.pad_token_id)
    rows = list(samples)
    targets = sum(int(s["loss_mask"][1:].sum()) for s in rows)
    with torch.no_grad():
        full = collate(rows)
        padded = sft_loss(forward_logits(model, full), full["input_ids"], full["loss_mask"], num_tokens=targets)
        plan = plan_micro_batches([len(s["input_ids"]) for s in rows], max_tokens=64)[0]
        assert len(plan) > 1
        split = sum(sft_loss(forward_logits(model, b), b["input_ids"], b["loss_mask"], num_tokens=targets)
                    for b in (collate([rows[i] for i in micro]) for micro in plan))
    assert abs(float(padded) - float(split)) < 1e-5


def test_freezing_the_visual_encoder_trains_the_language_model_only(vlm_assets, vlm):
    _, tokenizer, samples = vlm
    model = load_causal_lm(str(vlm_assets.model_dir))
    vision = set(vision_parameter_names(model))
    assert freeze_visual_encoder(model) == len(vision) > 0
    assert all(p.requires_grad == (n not in vision) for n, p in model.named_parameters())
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    batch = make_collate(tokenizer.pad_token_id)(list(samples)[:2])
    sft_loss(forward_logits(model, batch), batch["input_ids"], batch["loss_mask"]).backward()
    optimizer.step()
    after = dict(model.named_parameters())
    assert all(torch.equal(before[n], after[n]) for n in vision)
    assert sum(not torch.equal(before[n], after[n]) for n in before if n not in vision) > 0


def test_multiturn_sft_places_each_image_in_its_turn_and_trains_on_the_answers_only(vlm_assets, vlm):
    from rlhfkit.data.readers import Record

    model, tokenizer, _ = vlm
    path = str(vlm_assets.model_dir)
    images = record_images(load_model_config(path), path, tokenizer, "images", 2)
    image = str(vlm_assets.data_dir / vlm_assets.read("sft_train")[0]["images"][0])
    conversation = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many dots?"}]},
                    {"role": "assistant", "content": "3"},
                    {"role": "user", "content": [{"type": "text", "text": "And here?"}, {"type": "image"}]},
                    {"role": "assistant", "content": "2"}]
    record = Record({"conv": conversation, "images": [image, image]}, "x.jsonl", 0)
    sample = SFTDataset([record], tokenizer, 128, input_key="conv", multiturn=True, images=images)[0]
    ids, mask = sample["input_ids"], sample["loss_mask"]
    assert tokenizer.decode(ids[mask.bool()]) == "3</s>2</s>"
    vision = (ids == model.config.image_token_id).nonzero().flatten().tolist()
    second_turn = int((ids == tokenizer.convert_tokens_to_ids("<|user|>")).nonzero()[1])
    assert len(vision) == 8 and vision[3] < second_turn < vision[4]
