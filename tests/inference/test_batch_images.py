"""batch_inference on image prompts (`--image_key`): two prompts of the tiny Qwen2-VL through the Transformers engine
in one padded batch give, greedily, what Transformers' own `generate` gives for each prompt alone with the same
pixel inputs; the vLLM task and reward scoring refuse images."""

from __future__ import annotations

import json

import pytest
import torch

from rlhfkit.cli import batch_inference
from rlhfkit.cli.common import run_cli
from rlhfkit.config.base import parse_config
from rlhfkit.config.batch_inference import BatchInferenceConfig
from rlhfkit.errors import UserError

NEW_TOKENS = 6


def direct_generate(vlm_assets, records: list[dict]) -> list[str]:
    """Each prompt alone through Qwen2VLForConditionalGeneration.generate: the chat template with the model's image
    placeholder first, bos, the image-pad token repeated per vision token (4 for a 56 x 56 image), greedy."""
    from PIL import Image
    from transformers import AutoTokenizer, Qwen2VLForConditionalGeneration

    from rlhfkit.models.vision import load_image_processor

    path = str(vlm_assets.model_dir)
    tok = AutoTokenizer.from_pretrained(path)
    model = Qwen2VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    processor = load_image_processor(path)
    pad = model.config.image_token_id
    outs = []
    for r in records:
        image = Image.open(vlm_assets.data_dir / r["images"][0]).convert("RGB")
        pixels = processor(images=[image], return_tensors="pt")
        text = tok.apply_chat_template([{"role": "user", "content": "<|vision_start|><|image_pad|><|vision_end|>"
                                         + r["prompt"]}], tokenize=False, add_generation_prompt=True)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        ids = ids if ids[:1] == [tok.bos_token_id] else [tok.bos_token_id, *ids]
        ids = [t for i in ids for t in ([i] * 4 if i == pad else [i])]
        x = torch.tensor([ids])
        with torch.no_grad():
            # mm_token_type_ids marks the image tokens for M-RoPE; without it generate reuses the previous
            # call's rope deltas (transformers 5.19) and the second prompt decodes from wrong positions
            y = model.generate(input_ids=x, attention_mask=torch.ones_like(x), mm_token_type_ids=(x == pad).long(),
                               pixel_values=pixels["pixel_values"].float(), image_grid_thw=pixels["image_grid_thw"],
                               max_new_tokens=NEW_TOKENS, do_sample=False)
        outs.append(tok.decode(y[0, x.shape[1]:], skip_special_tokens=True))
    return outs


def test_two_image_prompts_match_a_direct_hf_generate(vlm_assets, tmp_path, capsys):
    records = vlm_assets.read("rl_eval")[:2]
    out = tmp_path / "out.jsonl"
    argv = ["--eval_task", "generate", "--pretrain", str(vlm_assets.model_dir), "--dataset",
            str(vlm_assets.split("rl_eval")), "--max_samples", "2", "--input_key", "prompt", "--image_key", "images",
            "--apply_chat_template", "--greedy_sampling", "--max_new_tokens", str(NEW_TOKENS),
            "--micro_batch_size", "2", "--output_path", str(out)]
    assert run_cli(batch_inference.main, argv, prog="x") == 0, capsys.readouterr().err
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert [w["input"] for w in written] == [r["prompt"] for r in records]  # written as the records held them
    assert [w["output"] for w in written] == direct_generate(vlm_assets, records)


@pytest.mark.parametrize("task, why", [("generate_vllm", "vLLM cannot load a Qwen2-VL"),
                                       ("rm", "scores texts without their images")])
def test_images_go_to_the_transformers_engine_only(task, why):
    with pytest.raises(UserError, match=why):
        parse_config(BatchInferenceConfig, ["--eval_task", task, "--image_key", "images"], "x")


def test_max_images_needs_an_image_key():
    with pytest.raises(UserError, match="add --image_key"):
        parse_config(BatchInferenceConfig, ["--eval_task", "generate", "--max_images_per_prompt", "2"], "x")


def test_a_missing_image_stops_with_one_line_naming_the_record(vlm_assets, tmp_path, capsys):
    from tests.cli.test_bad_inputs import assert_one_line_error, call_in_process

    data = tmp_path / "d.jsonl"
    good = vlm_assets.read("rl_eval")[0]
    good["images"] = [str(vlm_assets.data_dir / good["images"][0])]
    data.write_text(json.dumps(good) + "\n" + json.dumps(dict(good, images=["gone.png"])) + "\n")
    code, err = call_in_process("batch_inference", [
        "--eval_task", "generate", "--pretrain", str(vlm_assets.model_dir), "--dataset", str(data), "--input_key",
        "prompt", "--image_key", "images", "--output_path", str(tmp_path / "o.jsonl")], capsys)
    assert_one_line_error(code, err, ("record 2", "gone.png", "does not exist"))
