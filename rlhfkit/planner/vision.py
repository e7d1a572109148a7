"""The vision side of a vision-language model in `--dry_run`: the vision tower's states and the vision tokens.

A Qwen2-VL model (config.json with a `vision_config`) carries a vision tower next to its language model; the
planner's `ModelShape` reads only the language model (`text_config`). With `--image_key` this module adds, for each
role of the plan that loads the model:

- the vision tower's weights, and for a trained role its gradients and optimizer states (the same ZeRO arithmetic
  as the language model, `rlhfkit/planner/memory.py`); `--freeze_visual_encoder` leaves the actor's (SFT/DPO/KTO:
  the model's) tower without gradients or optimizer states;
- the vision tower's activations, added to the role's activation row (they live in the same forward/backward);
- the token budget: images per prompt (`--max_images_per_prompt`, an upper bound) x tokens per image, from the
  processor's `preprocessor_config.json`: `max_pixels` (`size.longest_edge`) / patch_size^2 patches, merged
  merge_size x merge_size into one language-model token. These tokens sit inside the prompt's `--max_len`
  (`--prompt_max_len`), so a prompt whose images alone need more is a failed check.

Images smaller than `max_pixels` make fewer tokens: the figures are the most a prompt can hold.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from rlhfkit.planner import memory as mem

TRAINED_ROLES = ("model", "actor", "critic")
ENGINE_ROLES = ("hf_engine", "vllm")


@dataclass(frozen=True)
class VisionShape:
    """A Qwen2-VL vision tower (config.json `vision_config`) and its processor's patching."""

    depth: int
    embed_dim: int
    mlp_hidden: int  # embed_dim x mlp_ratio
    num_heads: int
    out_hidden: int  # the language model's width, what the merger projects to
    patch_size: int
    merge_size: int
    temporal_patch_size: int
    in_channels: int
    max_pixels: int

    def params(self) -> int:
        """Parameters, counted module by module as Transformers' Qwen2VisionTransformerPretrainedModel holds them:
        the patch embedding (a bias-free Conv3d of in_channels x temporal x patch x patch per output), per block two
        LayerNorms (weight + bias), qkv and output projections and the two-layer MLP (all with biases), and the
        patch merger (a LayerNorm, then Linear(e m^2, e m^2) and Linear(e m^2, out), with biases)."""
        e, f, m2 = self.embed_dim, self.mlp_hidden, self.merge_size ** 2
        patch = self.in_channels * self.temporal_patch_size * self.patch_size ** 2 * e
        block = 4 * e + (3 * e * e + 3 * e) + (e * e + e) + (e * f + f) + (f * e + e)
        merger = 2 * e + (e * m2 * e * m2 + e * m2) + (e * m2 * self.out_hidden + self.out_hidden)
        return patch + self.depth * block + merger

    def patches_per_image(self) -> int:
        return self.max_pixels // self.patch_size ** 2

    def tokens_per_image(self) -> int:
        """Language-model tokens (`<|image_pad|>`) one image of max_pixels becomes."""
        return self.patches_per_image() // self.merge_size ** 2


def read_vision_shape(path: str | None) -> VisionShape | None:
    """The vision shape of the model directory `path`, None when it is not a vision-language model (no
    `vision_config` in config.json, or no config.json / preprocessor_config.json to read)."""
    if not path:
        return None
    root = Path(path).expanduser()
    try:
        v = json.loads((root / "config.json").read_text(encoding="utf-8")).get("vision_config")
        p = json.loads((root / "preprocessor_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not v:
        return None
    e = int(v["embed_dim"])
    size = p.get("size") or {}
    max_pixels = int(p.get("max_pixels") or size.get("longest_edge") or 12845056)  # Qwen2-VL's default
    return VisionShape(depth=int(v["depth"]), embed_dim=e, mlp_hidden=int(e * v.get("mlp_ratio", 4)),
                       num_heads=int(v["num_heads"]), out_hidden=int(v["hidden_size"]),
                       patch_size=int(p.get("patch_size") or v["patch_size"]),
                       merge_size=int(p.get("merge_size") or v.get("spatial_merge_size", 2)),
                       temporal_patch_size=int(p.get("temporal_patch_size") or v.get("temporal_patch_size", 2)),
                       in_channels=int(v.get("in_channels", 3)), max_pixels=max_pixels)


def patch_activation_elements(v: VisionShape) -> int:
    """Elements one patch keeps for backward in one vision block: the block input and its two LayerNorm outputs
    (3e), qkv (3e), the attention output and its projection (2e), the MLP's hidden and activated hidden (2f) and
    its output (e), plus one log-sum-exp per head. An estimate by the same count as the language model's layers
    (`memory.layer_activation_elements`), not measured."""
    return 9 * v.embed_dim + 2 * v.mlp_hidden + v.num_heads


def vision_activations(v: VisionShape, images: int, bf16: bool, train: bool) -> float:
    """Bytes of the vision tower's activations for `images` images of max_pixels: the pixel patches (fp32), every
    block's saved elements when trained (one block's when only run forward: frozen or scoring), and the merger's
    three [tokens x e m^2] tensors plus its output."""
    width = 2 if bf16 else 4
    patches = images * v.patches_per_image()
    tokens = images * v.tokens_per_image()
    pixels = patches * v.in_channels * v.temporal_patch_size * v.patch_size ** 2 * 4
    blocks = (v.depth if train else 1) * patches * patch_activation_elements(v) * width
    merger = tokens * (3 * v.embed_dim * v.merge_size ** 2 + v.out_hidden) * width
    return pixels + blocks + merger


def _role_path(cfg: Any, role: str) -> str | None:
    if role == "reference":
        return cfg.reference.ref_pretrain or cfg.model.pretrain
    if role == "critic":
        return cfg.rl_model.critic_pretrain or cfg.rl_model.reward_pretrain or cfg.model.pretrain
    if role == "reward":
        return cfg.rl_model.reward_pretrain
    return cfg.model.pretrain


def vision_state_rows(weights: Any, v: VisionShape, cfg: Any, ranks: int, trained: bool) -> list[Any]:
    """The vision tower's weights (and gradients + optimizer states when `trained`) on one rank, as rows made
    from the role's language-model `weights` row (same role and phase)."""
    s, bf16, role = cfg.strategy, cfg.model.bf16, weights.role
    params = v.params()
    zero = 0 if role in ENGINE_ROLES else s.zero_stage  # an engine holds its own whole copy
    st = mem.trained_states(params, params if trained else 0, bf16, zero, ranks, s.adam_offload)
    note = f"{params / 1e6:.3f}M params x {'2 (bf16)' if bf16 else '4'}"
    rows = [replace(weights, component="vision tower " + weights.component, bytes=st.weights,
                    note=note + ("" if trained else ", frozen"))]
    if trained:
        rows += [replace(weights, component="vision tower gradients", bytes=st.gradients, note=f"ZeRO-{s.zero_stage}"),
                 replace(weights, component="vision tower optimizer states", phase="host" if s.adam_offload else
                         weights.phase, bytes=st.optimizer or st.optimizer_host, note="Adam, as the language model's")]
    return rows


def _is_trained(cfg: Any, role: str) -> bool:
    if role == "critic":
        return True
    return role in TRAINED_ROLES and not cfg.vision.freeze_visual_encoder


def _micro_rows(cfg: Any, trainer: str, role: str) -> int:
    """Sequences in one forward of `role`, as plan.py's activation rows count them."""
    if hasattr(cfg, "rollout"):  # an RL config
        trains = role in ("actor", "critic")
        return cfg.strategy.micro_train_batch_size if trains else cfg.rollout.micro_rollout_batch_size
    return cfg.strategy.micro_train_batch_size * (1 if trainer == "sft" else 2)


def _add_role(pool: Any, role: str, v: VisionShape, cfg: Any, ranks: int, images: int) -> None:
    rows = [r for r in pool.rows if r.role == role]
    weights = next((r for r in rows if r.component.startswith("weights")), None)
    if weights is None:
        return
    trained = _is_trained(cfg, role)
    new = vision_state_rows(weights, v, cfg, ranks, trained)
    where = pool.rows.index(rows[-1]) + 1
    pool.rows[where:where] = new
    act = next((r for r in rows if r.component == "activations"), None)
    if act is not None:
        act_images = images * _micro_rows(cfg, pool.name, role)
        act.bytes += vision_activations(v, act_images, cfg.model.bf16, train=trained)
        act.note += f", + vision: {act_images} images x {v.patches_per_image()} patches"


def add_vision_rows(pools: list[Any], cfg: Any, ranks_of: Any) -> None:
    """Add the vision rows to every role of `pools` whose model is a vision-language one, when `--image_key` is
    given; `ranks_of(role)` is the number of ranks a role is partitioned over (ZeRO-3)."""
    vision = getattr(cfg, "vision", None)
    if vision is None or not vision.image_key:
        return
    budget = cfg.data.prompt_max_len if hasattr(cfg.data, "prompt_max_len") else cfg.data.max_len
    images = vision.max_images_per_prompt
    for pool in pools:
        for role in dict.fromkeys(r.role for r in pool.rows):  # members and their reference, in order
            v = read_vision_shape(_role_path(cfg, role))
            if v is None:
                continue
            _add_role(pool, role, v, cfg, ranks_of(role), images)
            tokens = images * v.tokens_per_image()
            if tokens >= budget:
                pool.checks.append(f"{role}: {images} image(s) x {v.tokens_per_image()} vision tokens = {tokens} "
                                   f"tokens do not fit the prompt's {budget}-token budget")


def header_lines(cfg: Any) -> list[str]:
    """The plan's header line on the policy's vision tower and vision tokens (none without --image_key)."""
    vision: Any = getattr(cfg, "vision", None)
    v = read_vision_shape(cfg.model.pretrain) if vision is not None and vision.image_key else None
    if v is None:
        return []
    return [f"vision tower: {v.params() / 1e6:.3f}M parameters ({v.depth} blocks, width {v.embed_dim}), "
            f"{'frozen' if vision.freeze_visual_encoder else 'trained'}; {v.tokens_per_image()} tokens per image "
            f"(max_pixels {v.max_pixels}, patch {v.patch_size}, merge {v.merge_size}) x "
            f"{vision.max_images_per_prompt} image(s) per prompt"]
