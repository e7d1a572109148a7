"""The rules of `--ds_tensor_parallel_size` (tensor parallel training), checked once after parsing.

Tensor parallelism runs on `--backend fsdp2` only (torch's tensor parallel on a (dp, tp) device mesh,
`rlhfkit/distributed/tensor_parallel.py`); DeepSpeed's AutoTP is not used. It splits the attention heads, the KV
heads and the MLP's intermediate features over the TP ranks, so the TP size must divide each of them (read from the
model's config.json when --pretrain is a local directory) and the world size (the launcher's WORLD_SIZE), whose
quotient is the data-parallel size. The RL roles do not take it yet. DeepSpeed 0.19.8's AutoTP does train on
CPU/gloo (one step of the demo model with `tensor_parallel.autotp_size` 2 ran), but rlhfkit's DeepSpeed path (its
export and checkpoints gather ZeRO shards, not AutoTP's) does not drive it yet.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from rlhfkit.errors import UserError

FLAG = "--ds_tensor_parallel_size"


def shape_problem(tp: int, shape: dict[str, Any]) -> str | None:
    """What of a model's config (a config.json dict) `tp` does not divide, or None when it divides all of it."""
    heads = shape.get("num_attention_heads")
    sizes = {"attention heads": heads, "KV heads": shape.get("num_key_value_heads") or heads,
             "MLP intermediate size": shape.get("intermediate_size")}
    for what, size in sizes.items():
        if isinstance(size, int) and size % tp:
            return f"the model's {what} ({size})"
    return None


def local_model_shape(pretrain: str | None) -> dict[str, Any] | None:
    """The config.json of a local --pretrain directory (its text config for a multimodal one), else None."""
    if not pretrain or not (Path(pretrain).expanduser() / "config.json").is_file():
        return None  # a hub name or a GGUF file: the model's own check runs when it is split
    try:
        shape = json.loads((Path(pretrain).expanduser() / "config.json").read_text())
    except (OSError, ValueError):
        return None  # loading the model reports it
    return shape.get("text_config", shape) if isinstance(shape, dict) else None


def check_tensor_parallel(cfg: Any) -> None:
    """Stop (UserError, one line) on a TP size the run cannot use."""
    strategy = getattr(cfg, "strategy", None)
    tp = getattr(strategy, "ds_tensor_parallel_size", 1)
    if tp < 1:
        raise UserError(f"{FLAG} {tp}: expected a positive size")
    if tp == 1 or strategy is None:
        return
    if strategy.backend != "fsdp2":
        raise UserError(f"{FLAG} {tp} needs --backend fsdp2 (torch tensor parallel); DeepSpeed's AutoTP is not "
                        "wired into rlhfkit yet: add --backend fsdp2")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world % tp:
        raise UserError(f"{FLAG} {tp} does not divide the world size ({world}); the data-parallel size is world / "
                        "tensor parallel size")
    if getattr(strategy, "ring_attn_size", 1) > 1:
        raise UserError(f"{FLAG} {tp} with --ring_attn_size: sequence and tensor parallelism do not combine yet; "
                        "pick one")
    model = getattr(cfg, "model", None)
    if getattr(model, "lora_rank", 0) > 0:
        raise UserError(f"{FLAG} {tp} does not take LoRA (--lora_rank): the adapters would need splitting too; "
                        f"drop one of them")
    problem = shape_problem(tp, local_model_shape(getattr(model, "pretrain", None)) or {})
    if problem:
        raise UserError(f"{FLAG} {tp} does not divide {problem}; pick a size that divides it")


def refuse_tensor_parallel_for_rl(strategy: Any) -> None:
    """The RL roles (actor, critic, reference, reward) do not take tensor parallelism yet."""
    tp = getattr(strategy, "ds_tensor_parallel_size", 1)
    if tp != 1:
        raise UserError(f"{FLAG} {tp}: tensor parallel training covers SFT, RM, DPO and KTO so far, not the RL "
                        f"roles: drop {FLAG}")
