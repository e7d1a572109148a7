"""Assembly shared by the trainers: strategy, tokenizer and model (with LoRA), logger, run directory."""

from __future__ import annotations

import dataclasses
import json
import os
from datetime import datetime
from typing import Any

import torch

from rlhfkit.config.common import LoggingArgs, ModelArgs, StrategyArgs
from rlhfkit.distributed.strategy import DeepSpeedStrategy
from rlhfkit.logging.metrics import MetricsLogger
from rlhfkit.models.loading import (
    check_model_path,
    load_causal_lm,
    load_tokenizer,
    quantization_config,
    resolve_attn_implementation,
)
from rlhfkit.models.lora import apply_lora


def make_strategy(model_args: ModelArgs, strategy_args: StrategyArgs) -> DeepSpeedStrategy:
    """A strategy whose batch arithmetic is validated; call `setup_distributed()` once inputs are checked."""
    return DeepSpeedStrategy(strategy_args, bf16=model_args.bf16,
                             gradient_checkpointing=model_args.gradient_checkpointing,
                             gradient_checkpointing_use_reentrant=model_args.gradient_checkpointing_use_reentrant)


def load_tokenizer_for(model_args: ModelArgs, padding_side: str = "right") -> Any:
    path = check_model_path(model_args.pretrain)
    return load_tokenizer(path, use_fast=not model_args.disable_fast_tokenizer, padding_side=padding_side)


def load_trainable_lm(model_args: ModelArgs, path: str | None = None, flag: str = "--pretrain") -> Any:
    """A causal LM ready for `strategy.prepare_train` (fp32 master weights, LoRA applied if asked, a 4-bit base
    with --load_in_4bit)."""
    path = check_model_path(path or model_args.pretrain, flag)
    attn = resolve_attn_implementation(model_args.attn_implementation, model_args.flash_attn)
    quantization = quantization_config(model_args.load_in_4bit, model_args.lora_rank, model_args.bf16)
    model = load_causal_lm(path, attn_implementation=attn, dtype=torch.float32, flag=flag, quantization=quantization)
    if model_args.lora_rank > 0:
        model = apply_lora(model, model_args.lora_rank, model_args.lora_alpha, model_args.lora_dropout,
                           model_args.target_modules)
        if model_args.gradient_checkpointing:
            model.enable_input_require_grads()
    return model


def run_name(kind: str) -> str:
    return f"{kind}_{datetime.now():%Y%m%d_%H%M%S}"


def make_logger(strategy: DeepSpeedStrategy, logging_args: LoggingArgs, save_path: str, kind: str,
                config: Any) -> MetricsLogger:
    """Metrics sinks on rank 0; the config is saved next to the metrics for reproducibility."""
    as_dict = dataclasses.asdict(config)
    if strategy.is_rank0:
        os.makedirs(save_path, exist_ok=True)
        with open(os.path.join(save_path, "rlhfkit_args.json"), "w") as f:
            json.dump(as_dict, f, indent=1, default=str)
    return MetricsLogger(logging_args, save_path, run_name(kind), as_dict, enabled=strategy.is_rank0)


def build_strategy(model_args: ModelArgs, strategy_args: StrategyArgs) -> DeepSpeedStrategy:
    """`make_strategy` and join the process group at once (when no input checks must come first)."""
    strategy = make_strategy(model_args, strategy_args)
    strategy.setup_distributed()
    return strategy
