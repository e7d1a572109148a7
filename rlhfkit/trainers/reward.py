"""Reward-model training on preference pairs.

Reward model: a causal-LM backbone with a scalar head (`rlhfkit.models.value_model`), read at the last token of
prompt + response. Chosen and rejected rows go through ONE forward pass (`pair_collate`: chosen rows first), and
the Bradley-Terry pairwise loss (`pairwise_rm_loss`, Ouyang et al. 2022, InstructGPT; margin as in Llama 2,
Touvron et al. 2023) pushes r(chosen) above r(rejected). After training, the mean and standard deviation of the
rewards over the training pairs are written into the saved config (`reward_mean`, `reward_std`, plus
`normalize_reward`) so that PPO and serve_rm can normalise rewards later. The loop is `PreferenceTrainer`
(`rlhfkit.trainers.preference`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from rlhfkit.algorithms.preference_losses import pairwise_rm_loss
from rlhfkit.config.backend import layout_name
from rlhfkit.config.preference import RMConfig
from rlhfkit.models.value_model import sequence_rewards
from rlhfkit.trainers.offline import to_device
from rlhfkit.trainers.preference import (
    PreferenceTrainer,
    Sums,
    load_frozen_model,
    load_pair_datasets,
    pair_sums,
    sequence_logps,
    tokenizer_source,
)


class RewardModelTrainer(PreferenceTrainer):
    kind = "rm"

    def __init__(self, *args: Any, loss_kind: str = "sigmoid", use_margin: bool = False, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.loss_kind = loss_kind
        self.use_margin = use_margin

    def pair_rewards(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Rewards of the chosen and the rejected rows of one pair batch, from one forward pass."""
        rewards = sequence_rewards(self.engine, batch)
        pairs = batch["margin"].numel()
        return rewards[:pairs], rewards[pairs:]

    def pair_loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The pairwise loss of one batch, with the chosen and rejected rewards it compared."""
        chosen, rejected = self.pair_rewards(batch)
        margin = batch["margin"] if self.use_margin else None
        return pairwise_rm_loss(chosen, rejected, margin, kind=self.loss_kind), chosen, rejected

    def loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, Sums]:
        loss, chosen, rejected = self.pair_loss(to_device(batch, self.strategy.device))
        return loss, pair_sums(loss.detach(), chosen.detach(), rejected.detach())

    @torch.no_grad()
    def reward_statistics(self, limit: int = -1) -> tuple[float, float]:
        """Mean and standard deviation of the rewards of both sides of the training pairs (the first `limit`
        pairs; -1: all), over every rank."""
        self.engine.eval()
        moments = torch.zeros(3, dtype=torch.float64)
        for batch, real in self.sharded_batches(self.train_samples, limit):
            chosen, rejected = self.pair_rewards(to_device(batch, self.strategy.device))
            if real:
                r = torch.cat([chosen, rejected]).double().cpu()
                moments += torch.stack([r.new_tensor(float(r.numel())), r.sum(), (r * r).sum()])
        self.engine.train()
        count, total, squares = self.strategy.all_reduce(moments, "sum").tolist()
        mean = total / max(count, 1.0)
        var = squares / max(count, 1.0) - mean * mean
        return mean, math.sqrt(max(var, 0.0) * count / max(count - 1.0, 1.0))


def run_rm(cfg: RMConfig) -> RewardModelTrainer:
    """Assemble (`setup.assemble_offline`) and run reward-model training from an `RMConfig`; saves a model
    `load_value_model` reads back, with the reward statistics in its config."""
    from functools import partial

    from rlhfkit.data.collate import pair_collate
    from rlhfkit.run.setup import assemble_offline

    cfg.check_inputs()  # the flags were validated when parsed
    t, use_margin = cfg.train, cfg.pairs.margin_key is not None
    run = assemble_offline(cfg, "rm", partial(load_pair_datasets, need_margin=use_margin),
                           load_model=load_reward_model)
    strategy = run.strategy
    strategy.print(f"rm: {len(run.train)} pairs, {run.steps} optimizer steps, world size {strategy.world_size}, "
                   f"{layout_name(cfg.strategy)}, gradient accumulation {strategy.accumulation_steps}")
    collate = partial(pair_collate, pad_id=run.tokenizer.pad_token_id, packing=cfg.data.packing_samples)
    trainer = RewardModelTrainer(strategy, run.engine, run.tokenizer, run.train, run.evalset, collate,
                                 max_epochs=t.max_epochs, max_steps=t.max_steps, logging_args=cfg.logging,
                                 ckpt_args=cfg.checkpoint, logger=run.logger, packing=cfg.data.packing_samples,
                                 loss_kind=t.loss, use_margin=use_margin, run=run.run)
    stats: list[float] = []

    def reward_statistics_into_config() -> None:
        stats.extend(trainer.reward_statistics(t.reward_stats_samples))
        model: Any = strategy.unwrap(run.engine)  # the Transformers reward model (nn.Module types .config badly)
        config = model.config
        config.reward_mean, config.reward_std = stats
        config.normalize_reward = t.normalize_reward
        run.logger.log(trainer.state.global_step, {"reward_mean": stats[0], "reward_std": stats[1]}, prefix="stats")

    run.fit_and_save(trainer, cfg.checkpoint.save_path, "rm", before_save=reward_statistics_into_config)
    strategy.print(f"rm: reward mean {stats[0]:.4g}, std {stats[1]:.4g}")
    return trainer


def load_reward_model(cfg: RMConfig) -> Any:
    """The model train_rm trains: --pretrain with a value head (new if it has none), LoRA adapters on the backbone
    with --lora_rank (the head trained in full; saved merged)."""
    from rlhfkit.models.loading import check_model_path, resolve_attn_implementation
    from rlhfkit.models.lora import apply_lora
    from rlhfkit.models.value_model import load_value_model

    m = cfg.model
    model = load_value_model(check_model_path(m.pretrain), value_head_prefix=cfg.train.value_head_prefix,
                             attn_implementation=resolve_attn_implementation(m.attn_implementation, m.flash_attn),
                             flag="--pretrain", require_head=False)
    if m.lora_rank <= 0:
        return model
    adapted = apply_lora(model, m.lora_rank, m.lora_alpha, m.lora_dropout, m.target_modules,
                         head=cfg.train.value_head_prefix)
    if m.gradient_checkpointing:
        adapted.enable_input_require_grads()
    return adapted


def preference_accuracy(model_or_path: Any, records: Sequence[Any], tokenizer: Any = None, *,
                        ref_model_or_path: Any = None, prompt_key: str | None = "prompt", chosen_key: str = "chosen",
                        rejected_key: str = "rejected", input_template: str | None = None,
                        apply_chat_template: bool = False, max_len: int = 512, batch_size: int = 16,
                        value_head_prefix: str = "score") -> float:
    """Fraction of pairs in `records` where the chosen response scores above the rejected one.

    The score is, for a reward model (a saved train_rm directory or a sequence-classification module), its
    reward; for a causal LM with `ref_model_or_path`, DPO's implicit reward log pi(y|x) - log ref(y|x); for a
    causal LM alone, the sequence log-prob log pi(y|x). Runs in-process on the CPU (or the model's device).
    """
    from rlhfkit.data.collate import pair_collate
    from rlhfkit.data.preference_dataset import PreferenceDataset

    model = load_frozen_model(model_or_path, value_head_prefix)
    ref = load_frozen_model(ref_model_or_path, value_head_prefix) if ref_model_or_path is not None else None
    if tokenizer is None:
        from rlhfkit.models.loading import load_tokenizer

        tokenizer = load_tokenizer(tokenizer_source(model_or_path, model))
    pairs = PreferenceDataset(records, tokenizer, max_len, prompt_key=prompt_key, chosen_key=chosen_key,
                              rejected_key=rejected_key, input_template=input_template,
                              apply_chat_template=apply_chat_template)
    is_reward_model = hasattr(model.config, "value_head_prefix") or type(model).__name__.endswith(
        "ForSequenceClassification")
    device = next(model.parameters()).device
    correct = 0
    with torch.no_grad():
        for start in range(0, len(pairs), batch_size):
            chunk = [pairs[i] for i in range(start, min(start + batch_size, len(pairs)))]
            batch = to_device(pair_collate(chunk, pad_id=tokenizer.pad_token_id), device)
            if is_reward_model:
                scores = sequence_rewards(model, batch)
            else:
                scores = sequence_logps(model, batch)[0]
                if ref is not None:
                    scores = scores - sequence_logps(ref, batch)[0]
            n = len(chunk)
            correct += int((scores[:n] > scores[n:]).sum())
    return correct / max(len(pairs), 1)
