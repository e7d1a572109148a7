"""Supervised fine-tuning: next-token cross-entropy on response tokens, in the shared loop of `loop.py`.

The loss of an optimizer step is the mean over every target token of the step (all micro-batches, all ranks): each
micro-batch's summed loss is divided by the step's target count, so the gradient is the same whatever the split
(--micro_train_batch_size, world size, or a --max_tokens_per_gpu budget).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from rlhfkit.algorithms.sft_loss import sft_loss
from rlhfkit.config.backend import layout_name
from rlhfkit.config.base import required
from rlhfkit.config.sft import SFTConfig
from rlhfkit.data.tokens import as_long
from rlhfkit.models.moe import router_aux_loss
from rlhfkit.models.policy import dense_rows, first_target_position, forward_logits, from_position
from rlhfkit.models.sequence_parallel import sequence_parallel_logprobs, sequence_parallel_size
from rlhfkit.trainers.offline import Collate, OfflineTrainer, to_device


def non_pad_tokens(batch: dict[str, torch.Tensor]) -> int:
    """Real tokens of a padded (attention_mask) or packed (sample_ids, -1 = padding) batch."""
    if "attention_mask" in batch:
        return int(batch["attention_mask"].sum())
    if "sample_ids" in batch:
        return int((batch["sample_ids"] >= 0).sum())
    return int(batch["input_ids"].numel())


class SFTTrainer(OfflineTrainer):
    kind = "sft"

    # -- one micro-batch ------------------------------------------------------------------------------------
    def micro_loss(self, batch: dict[str, torch.Tensor], step_tokens: float | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(loss to optimise, its cross-entropy part, the MoE router loss or None) of one on-device micro-batch.

        The cross-entropy part is the micro-batch's summed token NLL divided by `step_tokens` (the optimizer step's
        target count on this rank; default: this micro-batch's own, i.e. its mean), and the MoE router
        load-balancing loss (`rlhfkit.models.moe`) counts with aux_loss_coef x the micro-batch's share of those
        tokens, so micro-batches of any size add up to the step's loss.

        `batch` may still be on the host: the layout decisions (token count, denser rows, first target column) read
        it there, so a GPU gets the batch with no host sync in between (bench/results/gpu_profile.md)."""
        targets = int(batch["loss_mask"][:, 1:].sum())
        if sequence_parallel_size() > 1:  # this rank's slice of the tokens: the group's parts sum to the loss
            logps, _, _, _ = sequence_parallel_logprobs(self.engine, to_device(batch, self.strategy.device))
            ce = -logps.sum() / (step_tokens or max(targets, 1))
            return ce, ce, None
        # The same loss, cheaper: fewer, fuller rows where the padding allows, and no LM head on prompt columns
        batch = dense_rows(self.engine, batch)
        start = first_target_position(batch)
        batch = to_device(batch, self.strategy.device)
        with router_aux_loss(self.engine, self.aux_loss_coef > 0) as aux:
            logits = forward_logits(self.engine, batch, start)
        step_tokens = step_tokens or max(targets, 1)
        window = from_position(batch, start)
        ce = sft_loss(logits, window["input_ids"], window["loss_mask"], sample_ids=window.get("sample_ids"),
                      num_tokens=step_tokens)
        if not aux:
            return ce, ce, None
        return ce + self.aux_loss_coef * aux[0] * (targets / step_tokens), ce, aux[0]

    def micro_step(self, batch: dict[str, torch.Tensor], step_tokens: float
                   ) -> tuple[torch.Tensor, int, float | None]:
        """Forward and backward one micro-batch (`micro_loss` with the step's token count); returns the (detached)
        cross-entropy part, the micro-batch's token count and the MoE router loss (None for dense models /
        --aux_loss_coef 0)."""
        tokens = int(batch["loss_mask"].sum())  # counted on the host batch: no wait for the backward
        loss, ce, aux = self.micro_loss(batch, step_tokens)
        self.backward_and_step(loss)
        return ce.detach().double(), tokens, None if aux is None else aux.item()

    def target_tokens(self, indices: Iterable[int]) -> int:
        """Target tokens of these training samples (the first token of a sample is never one)."""
        return sum(int(as_long(self.train_samples[i]["loss_mask"])[1:].sum()) for i in indices)

    def train_batch(self, micro: Sequence[Sequence[int]], started: float,
                    global_batch: Sequence[int]) -> dict[str, float]:
        """One optimizer step over this rank's micro batches (sample indices); returns the step's metrics.

        `tokens_per_s` counts every non-pad token processed, `loss_tokens_per_s` the target tokens only."""
        step_tokens = max(self.target_tokens(global_batch), 1)
        # DeepSpeed averages gradients over ranks: each rank's share is normalised by step_tokens / world.
        per_rank = step_tokens / self.strategy.world_size
        losses, loss_tokens, tokens, aux_losses = [], 0, 0, []
        for batch, real in self.micro_batches(micro, global_batch):
            self.micro_scale = 1.0 if real else 0.0
            loss, n, aux = self.micro_step(batch, per_rank)
            if real:
                losses.append(loss)  # kept on the device: one host sync per step, not one per micro-batch
                tokens += non_pad_tokens(batch)
                loss_tokens += n
                if aux is not None:
                    aux_losses.append(aux)
        self.micro_scale = 1.0
        elapsed = max(time.perf_counter() - started, 1e-9)
        totals = self.strategy.all_reduce(torch.tensor([tokens, loss_tokens], dtype=torch.float64), "sum")
        totals /= self.args.ring_attn_size  # the ranks of a sequence-parallel group counted the same tokens
        metrics = {
            # Each rank's parts sum to its tokens' NLL / per_rank, so the step's token mean is their sum / world.
            "loss": self.strategy.all_reduce(float(sum(losses, torch.zeros((), dtype=torch.float64)).cpu()), "sum")
            / self.strategy.world_size,
            "lr": self.engine.get_lr()[0],
            "tokens_per_s": float(totals[0]) / elapsed,
            "loss_tokens_per_s": float(totals[1]) / elapsed,
            "epoch": self.state.epoch,
        }
        if aux_losses:  # every rank has them or none does (same model, same --aux_loss_coef)
            metrics["aux_loss"] = self.strategy.all_reduce(sum(aux_losses) / len(aux_losses))
        return metrics

    def progress_fields(self, metrics: dict[str, float]) -> dict[str, float]:
        """What the progress bar shows of a step's metrics."""
        return {"loss": metrics["loss"], "lr": metrics["lr"], "tok/s": int(metrics["tokens_per_s"])}

    @torch.no_grad()
    def evaluate(self, step: int) -> dict[str, float] | None:
        """Token-level mean loss on the eval set, sharded over ranks (`sharded_batches`: the same number of forwards
        on every rank, padding batches left out of the sums), so it equals the one-rank value."""
        if not self.eval_samples:
            return None
        self.engine.eval()
        total_loss = torch.zeros((), dtype=torch.float64)
        total_tokens = 0
        for batch, real in self.sharded_batches(self.eval_samples):
            batch = to_device(batch, self.strategy.device)
            logits = forward_logits(self.engine, batch)
            n = int(batch["loss_mask"][:, 1:].sum())
            if real and n:
                total_loss += sft_loss(logits, batch["input_ids"], batch["loss_mask"]).double().cpu() * n
                total_tokens += n
        self.engine.train()
        sums = self.strategy.all_reduce(torch.tensor([total_loss.item(), total_tokens], dtype=torch.float64), "sum")
        eval_loss = float(sums[0]) / max(float(sums[1]), 1.0)
        metrics = {"loss": eval_loss, "ppl": math.exp(min(eval_loss, 50))}
        self.logger.log(step, metrics, prefix="eval")
        return metrics


def load_sft_datasets(cfg: SFTConfig, tokenizer: Any) -> tuple[Any, Any]:
    """Tokenised (train, eval or None) SFTDatasets from --dataset / --eval_dataset."""
    from rlhfkit.data.readers import load_mixture
    from rlhfkit.data.sft_dataset import SFTDataset
    from rlhfkit.run.setup import load_record_images

    d = cfg.data
    images = load_record_images(cfg, tokenizer)

    def tokenised(spec: str, probs: str | None, split: str, max_samples: int, flag: str) -> SFTDataset:
        records = load_mixture(spec, probs, split, max_samples, cfg.strategy.seed, arg_name=flag)
        return SFTDataset.from_args(records, tokenizer, d, images)

    train = tokenised(required(d.dataset, "dataset"), d.dataset_probs, d.dataset_split, d.max_samples, "--dataset")
    evalset = tokenised(d.eval_dataset, None, d.eval_split, 10**9, "--eval_dataset") if d.eval_dataset else None
    return train, evalset


def run_sft(cfg: SFTConfig) -> SFTTrainer:
    """Assemble (`setup.assemble_offline`) and run SFT from an `SFTConfig`; saves the model."""
    from rlhfkit.data.collate import make_collate
    from rlhfkit.models.moe import check_aux_loss_coef
    from rlhfkit.run.setup import assemble_offline

    cfg.check_inputs()  # the flags were validated when parsed
    d, t = cfg.data, cfg.train
    check_aux_loss_coef(t.aux_loss_coef, cfg.model.pretrain)
    run = assemble_offline(cfg, "sft", load_sft_datasets)
    strategy = run.strategy
    strategy.print(f"sft: {len(run.train)} samples, {run.steps} optimizer steps, world size {strategy.world_size}, "
                   f"{layout_name(cfg.strategy)}, gradient accumulation {strategy.accumulation_steps}")
    collate: Collate = make_collate(run.tokenizer.pad_token_id, packing=d.packing_samples)
    trainer = SFTTrainer(strategy, run.engine, run.tokenizer, run.train, run.evalset, collate,
                         max_epochs=t.max_epochs, max_steps=t.max_steps, logging_args=cfg.logging,
                         ckpt_args=cfg.checkpoint, logger=run.logger, aux_loss_coef=t.aux_loss_coef,
                         packing=d.packing_samples, run=run.run)
    run.fit_and_save(trainer, cfg.checkpoint.save_path, "sft")
    return trainer
