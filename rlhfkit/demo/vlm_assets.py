"""Write the vision-language demo assets: a random-init tiny Qwen2-VL with its processor, and image task data.

Layout of `out_dir`:
    model/         Qwen2VLForConditionalGeneration (safetensors), its tokenizer (the demo BPE plus the vision
                   tokens `<|vision_start|>`, `<|image_pad|>`, `<|vision_end|>`, `<|video_pad|>`, and the demo chat
                   template) and its image processor (`preprocessor_config.json`): `--pretrain out_dir/model`
    data/          sft_{train,eval}.jsonl, pref_{train,eval}.jsonl, rl_{train,eval}.jsonl; images in data/images/
    manifest.json  seed, sizes, counts, parameter count and library versions

Records: SFT `{"prompt", "answer", "images": ["images/....png"], "task"}` (train with `--input_key prompt
--output_key answer --image_key images --apply_chat_template`), preference `{"prompt", "chosen", "rejected",
"images", "task"}`, RL `{"prompt", "answer", "images", "task"}` (`--label_key answer`). Image paths are relative to
the data files. Everything follows from the seed; a directory holding the same build is reused.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlhfkit.demo.assets import _move_into_place, _versions, write_jsonl
from rlhfkit.demo.vlm_tasks import IMAGE_SIZE, VLM_TASKS, make_image_problem, wrong_image_answer

VLM_ASSETS_FORMAT = 1
VISION_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>")
SPLITS = ("sft_train", "sft_eval", "pref_train", "pref_eval", "rl_train", "rl_eval")


@dataclass(frozen=True)
class VLMAssets:
    root: Path

    @property
    def model_dir(self) -> Path:
        return self.root / "model"

    @property
    def data_dir(self) -> Path:
        return self.root / "data"

    def split(self, name: str) -> Path:
        return self.data_dir / f"{name}.jsonl"

    def read(self, name: str) -> list[dict]:
        with open(self.split(name), encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]


def tiny_qwen2_vl_config(tokenizer: Any, **text_overrides: Any) -> Any:
    """The tiny Qwen2-VL's shape: a 4-layer, 128-wide language model (head dim 32, M-RoPE sections 4/6/6 of its 16
    rotary frequencies) and a 2-block, 64-wide vision tower with 14-pixel patches merged 2 x 2 into the language
    model's width: about 1.3M parameters."""
    from transformers import Qwen2VLConfig

    ids = dict(zip(("vision_start_token_id", "image_token_id", "vision_end_token_id", "video_token_id"),
                   tokenizer.convert_tokens_to_ids(list(VISION_TOKENS))))
    text = dict(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=344, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-5,
                initializer_range=0.06, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                         "mrope_section": [4, 6, 6]},
                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=True)
    text.update(text_overrides)
    vision = dict(depth=2, embed_dim=64, hidden_size=text["hidden_size"], num_heads=2, mlp_ratio=2, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2, initializer_range=0.06)
    return Qwen2VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True, **ids)


def _image_processor() -> Any:
    from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

    # Every image becomes IMAGE_SIZE x IMAGE_SIZE: 4 x 4 patches, 4 vision tokens after the 2 x 2 merge.
    side = IMAGE_SIZE * IMAGE_SIZE
    return Qwen2VLImageProcessorPil(min_pixels=side, max_pixels=side, patch_size=14, merge_size=2,
                                    temporal_patch_size=2)


def _write_model(model_dir: Path, seed: int, vocab_size: int) -> int:
    import torch
    from transformers import GenerationConfig, Qwen2VLForConditionalGeneration
    from transformers.utils import logging as hf_logging

    from rlhfkit.demo.tokenizer import build_tokenizer

    tokenizer = build_tokenizer(seed=seed, vocab_size=vocab_size)
    tokenizer.add_tokens(list(VISION_TOKENS), special_tokens=True)
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration(tiny_qwen2_vl_config(tokenizer))
    model.generation_config = GenerationConfig(bos_token_id=tokenizer.bos_token_id,
                                               eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id, do_sample=False)
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(model_dir)
    finally:
        hf_logging.enable_progress_bar()
    tokenizer.save_pretrained(model_dir)
    _image_processor().save_pretrained(model_dir)
    return sum(p.numel() for p in model.parameters())


def _records(split: str, n: int, rng: random.Random, image_dir: Path) -> list[dict]:
    records = []
    for i in range(n):
        problem = make_image_problem(rng.choice(VLM_TASKS), rng)
        name = f"images/{split}_{i:05d}.png"
        problem.pop("image").save(image_dir.parent / name)
        record = {"prompt": problem["prompt"], "images": [name], "task": problem["task"]}
        if split.startswith("pref"):
            record.update(chosen=problem["answer"], rejected=wrong_image_answer(problem, rng))
        else:
            record["answer"] = problem["answer"]
        records.append(record)
    return records


def _build_into(tmp: Path, key: dict) -> None:
    assets = VLMAssets(tmp)
    image_dir = assets.data_dir / "images"
    image_dir.mkdir(parents=True)
    counts = {}
    for split in SPLITS:
        rng = random.Random(f"rlhfkit-vlm-{key['seed']}-{split}")  # splits independent of each other's sizes
        counts[split] = write_jsonl(assets.split(split), _records(split, key["sizes"][split], rng, image_dir))
    n_params = _write_model(assets.model_dir, key["seed"], key["vocab_size"])
    manifest = dict(key, counts=counts, n_params=n_params)
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _cached(assets: VLMAssets, key: dict) -> bool:
    try:
        manifest = json.loads((assets.root / "manifest.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return all(manifest.get(k) == v for k, v in key.items())


def build_vlm_assets(out_dir: str | os.PathLike, seed: int = 0, n_sft: int = 2000, n_eval: int = 200,
                     n_pref: int = 1000, n_rl: int = 1000, vocab_size: int = 1024,
                     force: bool = False) -> VLMAssets:
    """Build (or reuse) the vision-language demo assets under `out_dir` and return their paths. The build goes to
    a temporary sibling directory renamed into place, so a crash never leaves half an asset set."""
    sizes = {"sft_train": n_sft, "sft_eval": n_eval, "pref_train": n_pref, "pref_eval": n_eval, "rl_train": n_rl,
             "rl_eval": n_eval}
    key = {"format": VLM_ASSETS_FORMAT, "seed": int(seed), "vocab_size": int(vocab_size), "sizes": sizes,
           "versions": _versions()}
    assets = VLMAssets(Path(out_dir).expanduser().resolve())
    if not force and _cached(assets, key):
        return assets
    assets.root.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{assets.root.name}.building-", dir=assets.root.parent))
    try:
        _build_into(tmp, key)
        _move_into_place(tmp, assets.root)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return assets
