"""Reward-model training on preference pairs, and the loop shared by the preference trainers (RM, DPO, KTO).

Reward model: a causal-LM backbone with a scalar head (`rlhfkit.models.value_model`), read at the last token of
prompt + response. Chosen and rejected rows go through ONE forward pass (`pair_collate`: chosen rows first), and
the Bradley-Terry pairwise loss (`pairwise_rm_loss`, Ouyang et al. 2022, InstructGPT; margin as in Llama 2,
Touvron et al. 2023) pushes r(chosen) above r(rejected). After training, the mean and standard deviation of the
rewards over the training pairs are written into the saved config (`reward_mean`, `reward_std`, plus
`normalize_reward`) so that PPO and serve_rm can normalise rewards later.

`PreferenceTrainer` is the SFT loop (rlhfkit.trainers.sft) with one change: a micro step returns named metrics as
(sum, weight) pairs, reduced over micro batches and ranks into weighted means. So accuracies, per-label means and
losses are all exact over the whole optimizer step, whatever the micro-batch split.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from rlhfkit.algorithms.preference_losses import pairwise_rm_loss
from rlhfkit.models.value_model import sequence_rewards
from rlhfkit.trainers.sft import SFTTrainer, to_device

Sums = dict[str, tuple[float, float]]  # metric name -> (sum, weight); the reported value is sum / weight


def add_sums(total: dict[str, list[float]], part: Sums) -> None:
    for name, (value, weight) in part.items():
        acc = total.setdefault(name, [0.0, 0.0])
        acc[0] += float(value)
        acc[1] += float(weight)


class PreferenceTrainer(SFTTrainer):
    """SFTTrainer's loop with named, weighted metrics. Subclasses define `train_step`
    (forward, backward, step on one micro batch) and `eval_step` (forward only); both return `Sums`."""

    kind = "preference"

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.last_eval: dict[str, float] | None = None  # metrics of the latest evaluate()

    def train_step(self, batch: dict[str, torch.Tensor]) -> Sums:
        raise NotImplementedError

    def eval_step(self, batch: dict[str, torch.Tensor]) -> Sums:
        raise NotImplementedError

    def reduce(self, total: dict[str, list[float]]) -> dict[str, float]:
        """Weighted means over ranks: one all-reduce of every sum and weight (same key order on every rank)."""
        names = sorted(total)
        flat = torch.tensor([total[n][i] for n in names for i in (0, 1)], dtype=torch.float64)
        flat = self.strategy.all_reduce(flat, "sum")
        return {n: (flat[2 * k] / flat[2 * k + 1]).item() if flat[2 * k + 1] > 0 else float("nan")
                for k, n in enumerate(names)}

    def train_batch(self, micro: Iterable[Sequence[int]], started: float) -> dict[str, float]:
        sums: dict[str, list[float]] = {}
        for indices in micro:
            add_sums(sums, self.train_step(self.collate([self.train_samples[i] for i in indices])))
        metrics = self.reduce(sums)
        metrics.update(lr=self.engine.get_lr()[0], epoch=self.state.epoch,
                       samples_per_s=self.args.train_batch_size / max(time.perf_counter() - started, 1e-9))
        return metrics

    def progress_fields(self, metrics: dict[str, float]) -> dict[str, float]:
        return {k: metrics[k] for k in ("loss", "acc") if k in metrics}

    def sharded_batches(self, samples: Sequence[Any], limit: int | None = None):
        """This rank's share of `samples` in micro batches, yielded as (batch, is_real). Every rank yields the
        same number of batches (a rank that runs out repeats sample 0 with is_real False), because ZeRO-3
        forward passes are collective."""
        n = len(samples) if limit is None or limit < 0 else min(limit, len(samples))
        rank, world, m = self.strategy.rank, self.strategy.world_size, self.args.micro_train_batch_size
        mine = list(range(rank, n, world))
        num_batches = math.ceil(math.ceil(n / world) / m)
        for b in range(num_batches):
            chunk = mine[b * m:(b + 1) * m]
            yield self.collate([samples[i] for i in (chunk or [0])]), bool(chunk)

    @torch.no_grad()
    def evaluate(self, step: int) -> dict[str, float] | None:
        """Metrics of `eval_step` over the whole eval set (sharded over ranks), logged with prefix `eval`."""
        if not self.eval_samples:
            return None
        self.engine.eval()
        sums: dict[str, list[float]] = {}
        for batch, real in self.sharded_batches(self.eval_samples):
            part = self.eval_step(batch)
            add_sums(sums, part if real else {k: (0.0, 0.0) for k in part})
        self.engine.train()
        metrics = self.reduce(sums)
        self.logger.log(step, metrics, prefix="eval")
        self.strategy.print(f"{self.kind} eval at step {step}: " +
                            ", ".join(f"{k} {v:.4g}" for k, v in sorted(metrics.items())))
        self.last_eval = metrics
        return metrics


def pair_sums(loss: torch.Tensor, chosen: torch.Tensor, rejected: torch.Tensor) -> Sums:
    """Loss, accuracy (chosen scored above rejected), mean chosen/rejected scores and their margin."""
    n = chosen.numel()
    return {"loss": (loss.item() * n, n), "acc": ((chosen > rejected).sum().item(), n),
            "chosen_reward": (chosen.sum().item(), n), "rejected_reward": (rejected.sum().item(), n),
            "margin": ((chosen - rejected).sum().item(), n)}


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

    def loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        chosen, rejected = self.pair_rewards(batch)
        margin = batch["margin"] if self.use_margin else None
        return pairwise_rm_loss(chosen, rejected, margin, kind=self.loss_kind), chosen, rejected

    def train_step(self, batch: dict[str, torch.Tensor]) -> Sums:
        loss, chosen, rejected = self.loss(to_device(batch, self.strategy.device))
        self.engine.backward(loss)
        self.engine.step()
        return pair_sums(loss.detach(), chosen.detach(), rejected.detach())

    def eval_step(self, batch: dict[str, torch.Tensor]) -> Sums:
        loss, chosen, rejected = self.loss(to_device(batch, self.strategy.device))
        return pair_sums(loss, chosen, rejected)

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


def load_pair_datasets(cfg: Any, tokenizer: Any, need_margin: bool = False) -> tuple[Any, Any]:
    """Tokenised (train, eval or None) PreferenceDatasets from the data and pair sections of `cfg`."""
    from rlhfkit.data.preference_dataset import PreferenceDataset
    from rlhfkit.data.readers import load_mixture

    d, p = cfg.data, cfg.pairs

    def build(spec: str, probs: str | None, split: str, max_samples: int | None, flag: str) -> PreferenceDataset:
        records = load_mixture(spec, probs, split, max_samples, cfg.strategy.seed, arg_name=flag)
        return PreferenceDataset(records, tokenizer, d.max_len, prompt_key=p.prompt_key, chosen_key=p.chosen_key,
                                 rejected_key=p.rejected_key, margin_key=p.margin_key if need_margin else None,
                                 input_template=d.input_template, apply_chat_template=d.apply_chat_template,
                                 tokenizer_chat_template=d.tokenizer_chat_template)

    train = build(d.dataset, d.dataset_probs, d.dataset_split, d.max_samples, "--dataset")
    evalset = build(d.eval_dataset, None, d.eval_split, None, "--eval_dataset") if d.eval_dataset else None
    return train, evalset


def check_enough_samples(train: Sequence[Any], train_batch_size: int) -> None:
    from rlhfkit.errors import UserError

    if len(train) < train_batch_size:
        raise UserError(f"--dataset has {len(train)} usable samples, fewer than one --train_batch_size "
                        f"({train_batch_size})")


def run_rm(cfg: Any) -> RewardModelTrainer:
    """Assemble and run reward-model training from an `RMConfig`; saves a model `load_value_model` reads back."""
    from functools import partial

    from rlhfkit.config.preference import validate_rm_config
    from rlhfkit.data.collate import pair_collate
    from rlhfkit.errors import UserError
    from rlhfkit.models.loading import check_model_path, resolve_attn_implementation
    from rlhfkit.models.lora import apply_lora
    from rlhfkit.models.value_model import load_value_model
    from rlhfkit.trainers.setup import load_tokenizer_for, make_logger, make_strategy

    validate_rm_config(cfg)
    if cfg.train.aux_loss_coef > 0:
        raise UserError("--aux_loss_coef is not supported by train_rm (the reward head reads the backbone, which "
                        "returns no router loss); drop it")
    if cfg.model.load_in_4bit:
        raise UserError("--load_in_4bit is not supported by train_rm yet (QLoRA covers causal-LM training: "
                        "train_sft, train_dpo, train_kto and the RL actor); drop it")
    strategy = make_strategy(cfg.model, cfg.strategy)
    attn = resolve_attn_implementation(cfg.model.attn_implementation, cfg.model.flash_attn)
    path = check_model_path(cfg.model.pretrain)
    tokenizer = load_tokenizer_for(cfg.model)
    train, evalset = load_pair_datasets(cfg, tokenizer, need_margin=cfg.pairs.margin_key is not None)
    check_enough_samples(train, cfg.strategy.train_batch_size)
    strategy.setup_distributed()
    steps = (len(train) // cfg.strategy.train_batch_size) * cfg.train.max_epochs
    model = load_value_model(path, value_head_prefix=cfg.train.value_head_prefix, attn_implementation=attn,
                             flag="--pretrain")
    if cfg.model.lora_rank > 0:  # adapters on the backbone, the value head in full; saved merged
        m = cfg.model
        model = apply_lora(model, m.lora_rank, m.lora_alpha, m.lora_dropout, m.target_modules,
                           head=cfg.train.value_head_prefix)
        if m.gradient_checkpointing:
            model.enable_input_require_grads()
    engine = strategy.prepare_train(model, cfg.strategy.learning_rate, steps)
    logger = make_logger(strategy, cfg.logging, cfg.checkpoint.save_path, "rm", cfg)
    strategy.print(f"rm: {len(train)} pairs, {steps} optimizer steps, world size {strategy.world_size}, "
                   f"ZeRO-{cfg.strategy.zero_stage}, gradient accumulation {strategy.accumulation_steps}")
    collate = partial(pair_collate, pad_id=tokenizer.pad_token_id, packing=cfg.data.packing_samples)
    trainer = RewardModelTrainer(strategy, engine, tokenizer, train, evalset, collate,
                                 max_epochs=cfg.train.max_epochs, max_steps=cfg.train.max_steps,
                                 logging_args=cfg.logging, ckpt_args=cfg.checkpoint, logger=logger,
                                 loss_kind=cfg.train.loss,
                                 use_margin=cfg.pairs.margin_key is not None)
    try:
        trainer.fit()
        mean, std = trainer.reward_statistics(cfg.train.reward_stats_samples)
        config = strategy.unwrap(engine).config
        config.reward_mean, config.reward_std = mean, std
        config.normalize_reward = cfg.train.normalize_reward
        logger.log(trainer.state.global_step, {"reward_mean": mean, "reward_std": std}, prefix="stats")
        strategy.save_hf_model(engine, tokenizer, cfg.checkpoint.save_path)
    finally:
        logger.close()
    strategy.print(f"rm: reward mean {mean:.4g}, std {std:.4g}; model saved to {cfg.checkpoint.save_path}; "
                   f"metrics in {logger.path}")
    return trainer


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
    from rlhfkit.trainers.dpo import load_frozen_model, sequence_logps

    model = load_frozen_model(model_or_path, value_head_prefix)
    ref = load_frozen_model(ref_model_or_path, value_head_prefix) if ref_model_or_path is not None else None
    if tokenizer is None:
        from rlhfkit.models.loading import load_tokenizer

        tokenizer = load_tokenizer(str(model_or_path) if isinstance(model_or_path, (str, bytes)) or
                                   hasattr(model_or_path, "__fspath__") else model.name_or_path)
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
