"""`--dry_run` on a vision-language model (rlhfkit/planner/vision.py): the tiny demo Qwen2-VL's vision tower and
vision tokens in the plan, every byte figure computed by hand below. The model directory holds only config.json and
preprocessor_config.json (the tiny VLM's, rlhfkit/demo/vlm_assets.py), so nothing is loaded."""

from __future__ import annotations

import json

import pytest

from rlhfkit.config.base import parse_config
from rlhfkit.config.preference import DPOConfig
from rlhfkit.config.rl import PPOConfig
from rlhfkit.config.sft import SFTConfig
from rlhfkit.planner import vision
from rlhfkit.planner.memory import GIB
from rlhfkit.planner.plan import Devices, build_plan

GPU = Devices("gpu", 80 * GIB, 1, "test")
TEXT = {"hidden_size": 128, "intermediate_size": 344, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 1028, "max_position_embeddings": 1024, "tie_word_embeddings": True}
VISION = {"depth": 2, "embed_dim": 64, "hidden_size": 128, "in_channels": 3, "mlp_ratio": 2, "num_heads": 2,
          "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2}
PROCESSOR = {"merge_size": 2, "patch_size": 14, "temporal_patch_size": 2,
             "size": {"longest_edge": 3136, "shortest_edge": 3136}}  # 56 x 56 images

# The tiny VLM's vision tower by hand (Transformers counts 241024 for the built model: checked once when writing):
# patch embedding 3 x 2 x 14 x 14 x 64 = 75264; a block: 2 LayerNorms 4 x 64 = 256, qkv 64 x 192 + 192 = 12480,
# proj 64 x 64 + 64 = 4160, fc1 64 x 128 + 128 = 8320, fc2 128 x 64 + 64 = 8256: 33472, two of them 66944; merger:
# LayerNorm 128, Linear(256, 256) 65792, Linear(256, 128) 32896: 98816.
VISION_PARAMS = 75264 + 66944 + 98816
assert VISION_PARAMS == 241024
# fp32: 4 B weights, 4 B gradients, 8 B Adam moments per parameter
WEIGHTS, GRADS, ADAM = 4 * VISION_PARAMS, 4 * VISION_PARAMS, 8 * VISION_PARAMS


def vision_activation_bytes(images: int, trained: bool) -> int:
    """By hand: 3136 / 14^2 = 16 patches an image, 4 tokens after the 2 x 2 merge; pixels 16 x 3 x 2 x 14 x 14
    fp32; per patch and block 9 x 64 + 2 x 128 + 2 heads = 834 elements (every block trained, one frozen); merger
    per token 3 x 64 x 4 + 128 = 896 elements; fp32."""
    patches, tokens = 16 * images, 4 * images
    return patches * 3 * 2 * 196 * 4 + (2 if trained else 1) * patches * 834 * 4 + tokens * 896 * 4


@pytest.fixture
def vlm(tmp_path):
    d = tmp_path / "tiny-vlm"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "qwen2_vl", "text_config": TEXT,
                                               "vision_config": VISION}), encoding="utf-8")
    (d / "preprocessor_config.json").write_text(json.dumps(PROCESSOR), encoding="utf-8")
    return str(d)


def rows(plan, role: str) -> dict[str, float]:
    return {r.component: r.bytes for p in plan.pools for r in p.rows if r.role == role}


def sft_plan(vlm: str, *extra: str):
    argv = ["--pretrain", vlm, "--dataset", "x.jsonl", "--max_len", "64", "--micro_train_batch_size", "2", *extra]
    return build_plan(parse_config(SFTConfig, argv, "x"), "sft", GPU)


def test_shape_and_tokens_by_hand(vlm):
    v = vision.read_vision_shape(vlm)
    assert v is not None and v.params() == VISION_PARAMS
    assert (v.patches_per_image(), v.tokens_per_image()) == (16, 4)
    assert vision.read_vision_shape(None) is None


def test_sft_plan_has_vision_rows_checked_by_hand(vlm):
    text_only = rows(sft_plan(vlm), "model")
    plan = sft_plan(vlm, "--image_key", "images", "--max_images_per_prompt", "2")
    r = rows(plan, "model")
    assert "vision tower weights" not in text_only  # without --image_key the plan is the language model's
    assert r["vision tower weights"] == WEIGHTS
    assert r["vision tower gradients"] == GRADS
    assert r["vision tower optimizer states"] == ADAM
    # 2 rows x 2 images each go through the trained tower in the same forward/backward as the text
    assert r["activations"] - text_only["activations"] == vision_activation_bytes(4, trained=True)
    assert any("4 tokens per image" in line and "x 2 image(s)" in line for line in plan.header)


def test_frozen_and_trained_differ_by_the_towers_gradients_and_optimizer(vlm):
    trained = sft_plan(vlm, "--image_key", "images")
    frozen = sft_plan(vlm, "--image_key", "images", "--freeze_visual_encoder")
    f = rows(frozen, "model")
    assert "vision tower gradients" not in f and f["vision tower weights"] == WEIGHTS
    states = trained.pools[0].phase_bytes("resident") - frozen.pools[0].phase_bytes("resident")
    assert states == GRADS + ADAM
    act = rows(trained, "model")["activations"] - f["activations"]
    assert act == vision_activation_bytes(2, True) - vision_activation_bytes(2, False)


def test_dpo_counts_chosen_and_rejected_images_and_the_reference(vlm):
    argv = ["--pretrain", vlm, "--dataset", "x.jsonl", "--max_len", "64", "--micro_train_batch_size", "1",
            "--image_key", "images"]
    plan = build_plan(parse_config(DPOConfig, argv, "x"), "dpo", GPU)
    ref = rows(plan, "reference")
    assert ref["vision tower weights"] == WEIGHTS and "vision tower gradients" not in ref
    text = rows(build_plan(parse_config(DPOConfig, argv[:-2], "x"), "dpo", GPU), "model")
    assert rows(plan, "model")["activations"] - text["activations"] == vision_activation_bytes(2, trained=True)


def test_rl_actor_frozen_tower_reference_and_engine(vlm):
    argv = ["--pretrain", vlm, "--prompt_data", "x.jsonl", "--image_key", "images", "--freeze_visual_encoder",
            "--prompt_max_len", "32", "--generate_max_len", "8"]
    plan = build_plan(parse_config(PPOConfig, argv, "x"), "ppo", GPU)
    actor, engine = rows(plan, "actor"), rows(plan, "hf_engine")
    assert actor["vision tower weights"] == WEIGHTS and "vision tower gradients" not in actor
    assert engine["vision tower weights"] == WEIGHTS  # the engine's own copy


def test_vision_tokens_past_the_token_budget_fail_the_plan(vlm):
    plan = sft_plan(vlm, "--image_key", "images", "--max_images_per_prompt", "16")  # 64 tokens of a 64-token row
    assert not plan.fits
    assert "16 image(s) x 4 vision tokens = 64 tokens" in plan.pools[0].checks[0]
