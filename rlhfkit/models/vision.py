"""Vision-language models (the Qwen2-VL / Qwen2.5-VL family): what the data layer needs of them, their image
processor, the forward hook that gives them multimodal rotary positions, and freezing the vision tower.

Qwen2-VL places text and image tokens with multimodal rotary position ids (M-RoPE, Wang et al. 2024, "Qwen2-VL:
Enhancing Vision-Language Model's Perception of the World at Any Resolution"): an image's tokens share one temporal
index and take their row and column as the other two, text continues after the image's largest index. Transformers
computes them inside the forward pass from `input_ids`, `image_grid_thw` and `mm_token_type_ids` (1 on image
tokens). `add_multimodal_positions` fills `mm_token_type_ids` in from the ids, so every forward of the code base
(log-probs, value heads, generation) only passes `pixel_values` and `image_grid_thw` along. Packed rows
(`--packing_samples`: 2-D `position_ids` restarting at each sample) get each sample's own M-RoPE positions from the
same hook, since Transformers would number a packed row as one sequence.
"""

from __future__ import annotations

from typing import Any, TypeVar

import torch
from torch import nn

from rlhfkit.data.images import VisionTokens
from rlhfkit.errors import UserError

VISION_FAMILIES = ("qwen2_vl", "qwen2_5_vl")
M = TypeVar("M", bound=nn.Module)


def is_vision_config(config: Any) -> bool:
    """Whether a Transformers config is a vision-language model's (it has a vision tower)."""
    return getattr(config, "vision_config", None) is not None


def check_vision_family(config: Any, path: str, flag: str = "--pretrain") -> None:
    """A UserError unless `config` is a vision-language model rlhfkit can feed images to."""
    kind = getattr(config, "model_type", None)
    if not is_vision_config(config):
        raise UserError(f"--image_key needs a vision-language model, but {flag} {path} is a text-only {kind} model; "
                        f"use a {' / '.join(VISION_FAMILIES)} model or drop --image_key")
    if kind not in VISION_FAMILIES:
        raise UserError(f"{flag} {path} is a {kind} vision-language model; rlhfkit feeds images to "
                        f"{', '.join(VISION_FAMILIES)} models so far")


def vision_tokens(config: Any, tokenizer: Any) -> VisionTokens:
    """The image placeholder of a Qwen2-VL-family model: vision-start, one image-pad, vision-end (the pad token is
    repeated per vision token after tokenisation)."""
    ids = (config.vision_start_token_id, config.image_token_id, config.vision_end_token_id)
    placeholder = "".join(tokenizer.convert_ids_to_tokens(list(ids)))
    return VisionTokens(image_token_id=int(config.image_token_id), placeholder=placeholder,
                        merge_size=int(config.vision_config.spatial_merge_size))


def load_image_processor(path: str, flag: str = "--pretrain") -> Any:
    """The model's image processor (`preprocessor_config.json`). Qwen2-VL's PIL implementation: the default one
    needs torchvision, which the CPU install does not have, and both give the same pixels."""
    import json
    import os

    from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

    config_path = os.path.join(path, "preprocessor_config.json")
    if not os.path.isfile(config_path):
        raise UserError(f"{flag} {path}: no preprocessor_config.json (the image processor); save the model's "
                        "processor next to its weights")
    with open(config_path, encoding="utf-8") as f:
        settings = json.load(f)
    keep = ("min_pixels", "max_pixels", "patch_size", "merge_size", "temporal_patch_size", "image_mean",
            "image_std", "size", "do_resize", "do_rescale", "rescale_factor", "do_normalize", "do_convert_rgb")
    return Qwen2VLImageProcessorPil(**{k: settings[k] for k in keep if k in settings})


def image_runs(is_image: torch.Tensor) -> int:
    """How many images a row of vision-token flags [T] holds: its runs of consecutive vision tokens (one image's
    tokens are contiguous, and the vision-end and vision-start tokens separate two images)."""
    starts = is_image[1:] & ~is_image[:-1]
    return int(is_image[:1].sum()) + int(starts.sum())


def packed_multimodal_positions(model: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor,
                                image_grid_thw: torch.Tensor) -> torch.Tensor:
    """Position ids [4, R, T] of packed rows with images (docs/CONVENTIONS.md: `position_ids` [R, T] restart at 0 at
    each sample's first token; the images' `image_grid_thw` lines run in row order): row 0 the text positions as
    given (what flash-attention reads sample boundaries from), rows 1-3 each sample's M-RoPE positions computed on
    that sample alone by the model's own `get_rope_index`, so exactly what the padded forward of that sample gives."""
    inner = getattr(model, "model", model)
    config: Any = model.config
    image_token_id = int(config.image_token_id)
    segments = []  # (row, start, end, images) of every sample, padding included (no images: text positions)
    for r in range(input_ids.shape[0]):
        starts = (position_ids[r] == 0).nonzero().flatten().tolist()
        if not starts or starts[0] != 0:
            raise ValueError("packed rows with images need position_ids that start at 0 at each sample's first token")
        for a, b in zip(starts, [*starts[1:], input_ids.shape[1]]):
            segments.append((r, a, b, image_runs(input_ids[r, a:b] == image_token_id)))
    if sum(n for *_, n in segments) != image_grid_thw.shape[0]:
        raise ValueError(f"packed rows hold {sum(n for *_, n in segments)} images but image_grid_thw has "
                         f"{image_grid_thw.shape[0]} lines")
    mrope = position_ids[None].repeat(3, 1, 1)
    used = 0
    for r, a, b, n in segments:
        if n:
            ids = input_ids[r:r + 1, a:b]
            mrope[:, r, a:b] = inner.get_rope_index(  # type: ignore[operator]
                ids, (ids == image_token_id).int(), image_grid_thw=image_grid_thw[used:used + n])[0][:, 0]
            used += n
    return torch.cat([position_ids[None], mrope])


def _multimodal_inputs(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Forward pre-hook: `mm_token_type_ids` from the ids; for packed rows with images (2-D `position_ids`, which
    rlhfkit passes only for packed rows), their per-sample M-RoPE positions (`packed_multimodal_positions`)."""
    ids = kwargs.get("input_ids")
    if ids is None and args:
        ids = args[0]
    grids = kwargs.get("image_grid_thw")
    if grids is None or ids is None:
        return args, kwargs
    if kwargs.get("mm_token_type_ids") is None:
        kwargs["mm_token_type_ids"] = (ids == module.config.image_token_id).to(torch.int)  # type: ignore[union-attr]
    positions = kwargs.get("position_ids")
    if positions is not None and positions.ndim == 2:
        kwargs["position_ids"] = packed_multimodal_positions(module, ids, positions, grids)
    return args, kwargs


def add_multimodal_positions(model: M) -> M:
    """Give a Qwen2-VL-family model's forward the `mm_token_type_ids` its M-RoPE positions need (from the ids), and
    packed rows with images their per-sample M-RoPE positions."""
    model.register_forward_pre_hook(_multimodal_inputs, with_kwargs=True)
    return model


def multimodal_positions(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                         image_grid_thw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """M-RoPE position ids [3, B, T] of a (left- or right-) padded batch with images, and each row's offset [B]
    from text position to M-RoPE position after its last image (what a token generated next adds to its count of
    real tokens so far). Generation passes these explicitly, so a KV-cached decode continues exactly where the
    trainer's one-pass forward of the whole sequence puts the response."""
    inner = getattr(model, "model", model)
    mm_token_type_ids = (input_ids == model.config.image_token_id).to(torch.int)  # type: ignore[union-attr]
    positions, deltas = inner.get_rope_index(  # type: ignore[operator]
        input_ids, mm_token_type_ids, image_grid_thw=image_grid_thw, attention_mask=attention_mask)
    return positions, deltas.reshape(-1)


def vision_tower(model: nn.Module) -> nn.Module:
    """The vision encoder (with its patch merger) of a Qwen2-VL-family model, plain or PEFT-wrapped."""
    for owner in (model, getattr(model, "model", None), getattr(getattr(model, "base_model", None), "model", None)):
        for candidate in (owner, getattr(owner, "model", None)):
            tower = getattr(candidate, "visual", None)
            if isinstance(tower, nn.Module):
                return tower
    raise UserError(f"{type(model).__name__} has no vision tower (`visual`) to freeze")


def freeze_visual_encoder(model: nn.Module) -> int:
    """`--freeze_visual_encoder`: the vision tower stops training (the optimizer sees only the language model);
    returns how many tensors were frozen."""
    frozen = 0
    for p in vision_tower(model).parameters():
        p.requires_grad_(False)
        frozen += 1
    return frozen


def vision_parameter_names(model: nn.Module) -> list[str]:
    """Names (in `model.named_parameters()`) of the vision tower's tensors."""
    tower = {id(p) for p in vision_tower(model).parameters()}
    return [n for n, p in model.named_parameters() if id(p) in tower]


def frozen_vision_names(model: nn.Module) -> frozenset[str]:
    """`--freeze_visual_encoder` for an RL policy: freeze the vision tower and return its tensors' Transformers
    names (a PEFT wrapper's prefix stripped), which the weight sync leaves out: the engines keep the same ones."""
    names = frozenset(n.replace("base_model.model.", "", 1).replace(".base_layer", "")
                      for n in vision_parameter_names(model))
    freeze_visual_encoder(model)
    return names


def record_images(config: Any, path: str, tokenizer: Any, image_key: str, max_images: int) -> Any:
    """The data layer's reader of `--image_key` images for the vision-language model at `path` whose Transformers
    config is `config` (a UserError for a text-only model or an unsupported family)."""
    from rlhfkit.data.images import RecordImages

    check_vision_family(config, path)
    return RecordImages(vision_tokens(config, tokenizer), load_image_processor(path), image_key, max_images)
