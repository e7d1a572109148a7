"""Reward and critic models on the tiny Qwen2-VL (rlhfkit/models/vision_value.py): the value head sits on the
multimodal backbone, so image rows' rewards and values depend on their images, equal a direct Transformers forward
of the same checkpoint with its pixel inputs (fp32, 1e-5), and packed rows give what padded rows give."""

from __future__ import annotations

import pytest
import torch

from rlhfkit.data.collate import pair_collate
from rlhfkit.data.preference_dataset import PreferenceDataset
from rlhfkit.models.value_model import last_token_index, load_value_model, sequence_rewards, token_values
from rlhfkit.rl.experience import Experience, experience_from_samples
from rlhfkit.rl.role_forward import action_values, gather_actions, sample_rewards
from tests.rl.test_rl_images import image_prompts


@pytest.fixture(scope="module")
def vlm_value(vlm_assets):
    """(value model with a fresh head, tokenizer, the checkpoint's image reader)."""
    from rlhfkit.models.loading import load_tokenizer
    from rlhfkit.models.vision import record_images

    path = str(vlm_assets.model_dir)
    torch.manual_seed(0)
    model = load_value_model(path, flag="--pretrain", require_head=False).eval()
    tokenizer = load_tokenizer(path)
    return model, tokenizer, record_images(model.config, path, tokenizer, "images", 1)


def hf_token_values(vlm_assets, head: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The head on the final hidden states of Transformers' own Qwen2-VL causal LM, loaded from the same directory
    and given the pixel inputs directly (positions computed by Transformers)."""
    from transformers import Qwen2VLForConditionalGeneration

    lm = Qwen2VLForConditionalGeneration.from_pretrained(str(vlm_assets.model_dir), dtype=torch.float32).eval()
    ids = batch["input_ids"]
    with torch.no_grad():
        out = lm(input_ids=ids, attention_mask=batch["attention_mask"], pixel_values=batch["pixel_values"],
                 image_grid_thw=batch["image_grid_thw"], mm_token_type_ids=(ids == lm.config.image_token_id).int(),
                 output_hidden_states=True, use_cache=False)
        return head(out.hidden_states[-1]).squeeze(-1)


def image_experience(vlm_assets, tokenizer, images) -> Experience:
    from rlhfkit.rollout.engine import SampledSequence

    data, ids = image_prompts(vlm_assets, tokenizer, images, n=3)
    responses = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    samples = [SampledSequence(p, r, [-1.0] * len(r), "stop") for p, r in zip(ids, responses)]
    return experience_from_samples(samples, tokenizer.pad_token_id, [s["images"] for s in data.samples])


def test_critic_values_and_rewards_see_the_images_and_match_transformers(vlm_value, vlm_assets):
    model, tokenizer, images = vlm_value
    exp = image_experience(vlm_assets, tokenizer, images)
    with torch.no_grad():
        values, rewards = action_values(model, exp), sample_rewards(model, exp)
        packed = action_values(model, exp, packed=True)
        blind = action_values(model, Experience(**{**exp.to_dict(), "images": None}))
    mask = exp.action_mask
    direct = hf_token_values(vlm_assets, model.score, exp.model_inputs())
    assert (values - gather_actions(direct, exp.action_positions())).abs()[mask].max() < 1e-5
    rows, cols = last_token_index(exp.model_inputs())
    assert (rewards - direct[rows, cols]).abs().max() < 1e-5
    assert (packed - values).abs()[mask].max() < 1e-5
    assert (blind - values).abs()[mask].max() > 1e-3  # without the images the values are others


def test_packed_and_padded_reward_scores_of_image_pairs_agree(vlm_value, vlm_assets):
    model, tokenizer, images = vlm_value
    records = vlm_assets.read("pref_train")[:3]
    for r in records:
        r["images"] = [str(vlm_assets.data_dir / p) for p in r["images"]]
    pairs = list(PreferenceDataset(records, tokenizer, 128, prompt_key="prompt", apply_chat_template=True,
                                   images=images))
    with torch.no_grad():
        padded = sequence_rewards(model, pair_collate(pairs, pad_id=tokenizer.pad_token_id))
        packed = sequence_rewards(model, pair_collate(pairs, pad_id=tokenizer.pad_token_id, packing=True))
        values = token_values(model, pair_collate(pairs, pad_id=tokenizer.pad_token_id))
    assert padded.shape == (6,) and (packed - padded).abs().max() < 1e-5
    assert values.shape[0] == 6


def test_a_saved_vision_reward_model_loads_back_with_its_head(vlm_value, tmp_path):
    model, _, _ = vlm_value
    model.save_pretrained(tmp_path)
    again = load_value_model(str(tmp_path), flag="--reward_pretrain")
    assert type(again).__name__ == "Qwen2VLForValue"
    mine = model.state_dict()
    assert all(v.equal(mine[k]) for k, v in again.state_dict().items())


def test_lora_adapts_a_vision_reward_model_and_trains_its_head_in_full(vlm_assets):
    from rlhfkit.models.lora import apply_lora

    model = load_value_model(str(vlm_assets.model_dir), flag="--pretrain", require_head=False)
    adapted = apply_lora(model, 4, 8, 0.0, None, head="score")  # the merger's mlp.0 / mlp.2 by their whole names
    trained = [n for n, p in adapted.named_parameters() if p.requires_grad]
    assert any("merger.mlp.0.lora_A" in n for n in trained) and any("score" in n for n in trained)
    assert not any("blocks.0.lora" in n for n in trained)


def test_serve_rm_and_batch_inference_refuse_a_vision_reward_model(vlm_value, tmp_path):
    """Their RewardScorer scores texts: a vision reward model would score its inputs without their images."""
    from rlhfkit.errors import UserError
    from rlhfkit.rewards.scorer import load_scorer

    model, tokenizer, _ = vlm_value
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    with pytest.raises(UserError, match="vision-language reward model.*score texts without images"):
        load_scorer(str(tmp_path))
