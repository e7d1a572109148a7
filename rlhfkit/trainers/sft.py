"""Supervised fine-tuning: next-token cross-entropy on response tokens, in the shared loop of `loop.py`."""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from rlhfkit.algorithms.sft_loss import sft_loss
from rlhfkit.models.moe import router_aux_loss
from rlhfkit.models.policy import forward_logits
from rlhfkit.trainers.loop import Collate, TrainerLoop, to_device


class SFTTrainer(TrainerLoop):
    kind = "sft"

    # -- one micro-batch ------------------------------------------------------------------------------------
    def micro_loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(loss to optimise, its cross-entropy part, the MoE router loss or None) of one on-device micro-batch:
        loss = cross-entropy + aux_loss_coef x router load-balancing loss (`rlhfkit.models.moe`)."""
        with router_aux_loss(self.engine, self.aux_loss_coef > 0) as aux:
            logits = forward_logits(self.engine, batch)
        ce = sft_loss(logits, batch["input_ids"], batch["loss_mask"])
        if not aux:
            return ce, ce, None
        return ce + self.aux_loss_coef * aux[0], ce, aux[0]

    def micro_step(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int, float | None]:
        """Forward and backward one micro-batch; returns the (detached) cross-entropy, its token count and the MoE
        router loss (None for dense models / --aux_loss_coef 0)."""
        batch = to_device(batch, self.strategy.device)
        loss, ce, aux = self.micro_loss(batch)
        self.engine.backward(loss)
        self.engine.step()
        return ce.detach().float(), int(batch["loss_mask"].sum()), None if aux is None else aux.item()

    def train_batch(self, micro: Iterable[Sequence[int]], started: float) -> dict[str, float]:
        """One optimizer step over this rank's micro batches (sample indices); returns the step's metrics."""
        losses, tokens, aux_losses = [], 0, []
        for indices in micro:
            loss, n, aux = self.micro_step(self.collate([self.train_samples[i] for i in indices]))
            losses.append(loss)
            tokens += n
            if aux is not None:
                aux_losses.append(aux)
        elapsed = time.perf_counter() - started
        metrics = {
            "loss": self.strategy.all_reduce(torch.stack(losses).mean().item()),
            "lr": self.engine.get_lr()[0],
            "tokens_per_s": self.strategy.all_reduce(tokens, "sum") / max(elapsed, 1e-9),
            "epoch": self.state.epoch,
        }
        if aux_losses:  # every rank has them or none does (same model, same --aux_loss_coef)
            metrics["aux_loss"] = self.strategy.all_reduce(sum(aux_losses) / len(aux_losses))
        return metrics

    def progress_fields(self, metrics: dict[str, float]) -> dict[str, float]:
        """What the progress bar shows of a step's metrics."""
        return {"loss": metrics["loss"], "lr": metrics["lr"], "tok/s": int(metrics["tokens_per_s"])}

    @torch.no_grad()
    def evaluate(self, step: int) -> float | None:
        """Token-level mean loss on the eval set, sharded over ranks."""
        if not self.eval_samples:
            return None
        self.engine.eval()
        rank, world = self.strategy.rank, self.strategy.world_size
        total_loss = torch.zeros((), dtype=torch.float64)
        total_tokens = 0
        m = self.args.micro_train_batch_size
        mine = list(range(rank, len(self.eval_samples), world))
        for start in range(0, len(mine), m):
            batch = to_device(self.collate([self.eval_samples[i] for i in mine[start:start + m]]),
                              self.strategy.device)
            logits = forward_logits(self.engine, batch)
            n = int(batch["loss_mask"][:, 1:].sum())
            if n:
                total_loss += sft_loss(logits, batch["input_ids"], batch["loss_mask"]).double().cpu() * n
                total_tokens += n
        self.engine.train()
        loss_sum = self.strategy.all_reduce(total_loss.item(), "sum")
        token_sum = self.strategy.all_reduce(total_tokens, "sum")
        eval_loss = loss_sum / max(token_sum, 1)
        self.logger.log(step, {"loss": eval_loss, "ppl": math.exp(min(eval_loss, 50))}, prefix="eval")
        return eval_loss


def run_sft(cfg: Any) -> SFTTrainer:
    """Assemble and run SFT from an `SFTConfig`: data, model, strategy, trainer, final save."""
    from rlhfkit.data.collate import make_collate
    from rlhfkit.data.readers import load_mixture
    from rlhfkit.data.sft_dataset import SFTDataset
    from rlhfkit.errors import UserError
    from rlhfkit.models.moe import check_aux_loss_coef
    from rlhfkit.trainers.setup import load_tokenizer_for, load_trainable_lm, make_logger, make_strategy, prepare_run

    d = cfg.data
    if not d.dataset:
        raise UserError("--dataset is required: a local json/jsonl/parquet/csv/arrow file or dataset directory")
    strategy = make_strategy(cfg.model, cfg.strategy)  # validates batch arithmetic, joins no group yet
    run = prepare_run(cfg, "sft")
    check_aux_loss_coef(cfg.train.aux_loss_coef, cfg.model.pretrain, d.packing_samples)
    tokenizer = load_tokenizer_for(cfg.model)

    def tokenised(spec: str, probs: str | None, split: str, max_samples: int, flag: str) -> SFTDataset:
        records = load_mixture(spec, probs, split, max_samples, cfg.strategy.seed, arg_name=flag)
        return SFTDataset.from_args(records, tokenizer, d)

    train = tokenised(d.dataset, d.dataset_probs, d.dataset_split, d.max_samples, "--dataset")
    evalset = tokenised(d.eval_dataset, None, d.eval_split, 10**9, "--eval_dataset") if d.eval_dataset else None
    if len(train) < cfg.strategy.train_batch_size:
        raise UserError(f"--dataset has {len(train)} usable samples, fewer than one --train_batch_size "
                        f"({cfg.strategy.train_batch_size})")
    strategy.setup_distributed()
    collate: Collate = make_collate(tokenizer.pad_token_id, packing=d.packing_samples)
    steps = (len(train) // cfg.strategy.train_batch_size) * cfg.train.max_epochs
    model = load_trainable_lm(cfg.model)
    engine = strategy.prepare_train(model, cfg.strategy.learning_rate, steps)
    logger = make_logger(strategy, cfg.logging, cfg.checkpoint.save_path, "sft", cfg)
    strategy.print(f"sft: {len(train)} samples, {steps} optimizer steps, world size {strategy.world_size}, "
                   f"ZeRO-{cfg.strategy.zero_stage}, gradient accumulation {strategy.accumulation_steps}")
    trainer = SFTTrainer(strategy, engine, tokenizer, train, evalset, collate, max_epochs=cfg.train.max_epochs,
                         max_steps=cfg.train.max_steps, logging_args=cfg.logging, ckpt_args=cfg.checkpoint,
                         logger=logger, aux_loss_coef=cfg.train.aux_loss_coef, run=run)
    try:
        trainer.fit()
        strategy.save_hf_model(engine, tokenizer, cfg.checkpoint.save_path)
    finally:
        logger.close()
    strategy.print(f"sft: model saved to {cfg.checkpoint.save_path}; metrics in {logger.path}")
    return trainer
