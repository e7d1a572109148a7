"""Assembly shared by the trainers: strategy, tokenizer and model (with LoRA), logger, run directory, and the RL
runs' prompts, reward source and step count."""

from __future__ import annotations

import dataclasses
import json
import os
from datetime import datetime
from typing import Any

import torch

from rlhfkit.config.common import LoggingArgs, ModelArgs, StrategyArgs
from rlhfkit.config.rl import PPOConfig, remote_reward_urls, samples_per_rollout
from rlhfkit.distributed.strategy import DeepSpeedStrategy
from rlhfkit.errors import UserError
from rlhfkit.logging.metrics import MetricsLogger
from rlhfkit.models.loading import (
    check_model_path,
    load_causal_lm,
    load_tokenizer_for,  # noqa: F401 - the assembly helpers are imported from here
    quantization_config,
    resolve_attn_implementation,
)
from rlhfkit.models.lora import apply_lora


def make_strategy(model_args: ModelArgs, strategy_args: StrategyArgs) -> DeepSpeedStrategy:
    """A strategy whose batch arithmetic is validated; call `setup_distributed()` once inputs are checked."""
    return DeepSpeedStrategy(strategy_args, bf16=model_args.bf16,
                             gradient_checkpointing=model_args.gradient_checkpointing,
                             gradient_checkpointing_use_reentrant=model_args.gradient_checkpointing_use_reentrant)


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


# -- the RL runs (train_ppo, train_ppo_ray) ------------------------------------------------------------------
def load_prompts(cfg: PPOConfig, tokenizer: Any) -> tuple[Any, Any | None]:
    """(training prompts, evaluation prompts or None) as PromptDatasets."""
    from rlhfkit.data.prompt_dataset import PromptDataset
    from rlhfkit.data.readers import load_mixture

    d = cfg.data
    records = load_mixture(d.prompt_data, d.prompt_data_probs, d.prompt_split, d.max_samples, cfg.strategy.seed,
                           arg_name="--prompt_data")
    prompts = PromptDataset.from_args(records, tokenizer, d)
    eval_prompts = None
    if d.eval_dataset:
        eval_records = load_mixture(d.eval_dataset, None, d.eval_split, None, cfg.strategy.seed,
                                    arg_name="--eval_dataset")
        eval_prompts = PromptDataset.from_args(eval_records, tokenizer, d)
    if len(prompts) < cfg.rollout.rollout_batch_size:
        raise UserError(f"--prompt_data has {len(prompts)} prompts, fewer than one --rollout_batch_size "
                        f"({cfg.rollout.rollout_batch_size})")
    return prompts, eval_prompts


def num_update_steps(cfg: PPOConfig, num_prompts: int) -> int:
    """Optimizer steps of the whole run (for the learning-rate schedules)."""
    r = cfg.rollout
    rollout_steps = (num_prompts // r.rollout_batch_size) * r.num_episodes
    per_rollout = samples_per_rollout(cfg) // cfg.strategy.train_batch_size
    return max(rollout_steps * per_rollout * r.max_epochs, 1)


def make_text_reward(cfg: PPOConfig) -> Any:
    from rlhfkit.rollout.rewards import make_remote_reward

    m = cfg.rl_model
    return make_remote_reward(remote_reward_urls(cfg), timeout=m.remote_rm_timeout, retries=m.remote_rm_retries)
