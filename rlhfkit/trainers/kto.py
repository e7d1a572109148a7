"""Kahneman-Tversky Optimisation on unpaired completions labelled desirable or undesirable.

The loss is `rlhfkit.algorithms.preference_losses.kto_loss` (Ethayarajh et al. 2024, "KTO: Model Alignment as
Prospect Theoretic Optimization"): with r = log pi(y|x) - log ref(y|x), desirable completions are pushed to
r above the reference point z0, undesirable ones below it, each through a sigmoid with temperature beta and
weighted by --desirable_loss_weight / --undesirable_loss_weight.

z0 estimates KL(pi || ref) as in the paper: within each micro batch, prompt i is paired with the completion of
sample i-1 (`unpaired_collate(kl_rows=True)`), those mismatched rows are scored by policy and reference, and
z0 = max(0, mean(log pi - log ref)) over them (`kto_kl_reference_point`), detached and averaged over ranks. The B
real rows and the B mismatched rows go through ONE forward pass of each model.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from rlhfkit.algorithms.preference_losses import kto_kl_reference_point, kto_loss
from rlhfkit.config.backend import layout_name
from rlhfkit.config.base import required
from rlhfkit.config.preference import KTOConfig
from rlhfkit.trainers.offline import to_device
from rlhfkit.trainers.preference import (
    FrozenReference,
    PreferenceTrainer,
    Sums,
    load_frozen_model,
    prepare_policy_and_reference,
    sequence_logps,
    tokenizer_source,
)


def by_label(values: torch.Tensor, labels: torch.Tensor) -> tuple[tuple[float, float], tuple[float, float]]:
    """(sum, count) of `values` over desirable (label 1) and over undesirable (label 0) samples."""
    good = labels.bool()
    return ((values[good].sum().item(), float(good.sum())), (values[~good].sum().item(), float((~good).sum())))


class KTOTrainer(PreferenceTrainer):
    kind = "kto"

    def __init__(self, *args: Any, reference: FrozenReference, beta: float, desirable_loss_weight: float = 1.0,
                 undesirable_loss_weight: float = 1.0, compute_fp32_loss: bool = False, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.reference = reference
        self.beta = beta
        self.desirable_weight = desirable_loss_weight
        self.undesirable_weight = undesirable_loss_weight
        self.fp32 = compute_fp32_loss

    def loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, Sums]:
        batch = to_device(batch, self.strategy.device)
        labels = batch["labels"]
        n = labels.numel()
        want_aux = self.aux_loss_coef > 0
        policy, _, aux = sequence_logps(self.engine, batch, self.fp32, want_aux)  # n real rows, then n KL rows
        ref, _ = self.reference.logps(batch)
        z0 = kto_kl_reference_point(policy[n:].detach(), ref[n:])
        z0 = self.strategy.all_reduce(z0, "mean")  # the paper averages the estimate over devices
        loss, rewards = kto_loss(policy[:n], ref[:n], labels, z0, self.beta, self.desirable_weight,
                                 self.undesirable_weight)
        sums: Sums = {"kto_loss": (loss.item() * n, n), "kl": (float(z0) * n, n)}
        if want_aux and aux is not None:
            loss = loss + self.aux_loss_coef * aux
            sums["aux_loss"] = (aux.item() * n, n)
        sums["loss"] = (loss.item() * n, n)
        sums["desirable_reward"], sums["undesirable_reward"] = by_label(rewards, labels)
        sums["desirable_logps"], sums["undesirable_logps"] = by_label(policy[:n].detach(), labels)
        return loss, sums


def load_unpaired_datasets(cfg: KTOConfig, tokenizer: Any) -> tuple[Any, Any]:
    """Tokenised (train, eval or None) UnpairedDatasets from --dataset / --eval_dataset and the KTO keys."""
    from rlhfkit.data.preference_dataset import UnpairedDataset
    from rlhfkit.data.readers import load_mixture
    from rlhfkit.run.setup import load_record_images

    d = cfg.data
    images = load_record_images(cfg, tokenizer)

    def build(spec: str, probs: str | None, split: str, max_samples: int | None, flag: str) -> UnpairedDataset:
        records = load_mixture(spec, probs, split, max_samples, cfg.strategy.seed, arg_name=flag)
        return UnpairedDataset(records, tokenizer, d.max_len, input_key=d.input_key,
                               output_key=d.output_key or "output", label_key=cfg.unpaired.label_key,
                               input_template=d.input_template, apply_chat_template=d.apply_chat_template,
                               tokenizer_chat_template=d.tokenizer_chat_template, images=images)

    train = build(required(d.dataset, "dataset"), d.dataset_probs, d.dataset_split, d.max_samples, "--dataset")
    evalset = build(d.eval_dataset, None, d.eval_split, None, "--eval_dataset") if d.eval_dataset else None
    return train, evalset


def run_kto(cfg: KTOConfig) -> KTOTrainer:
    """Assemble and run KTO from a `KTOConfig`; saves the policy as a Hugging Face model."""
    from functools import partial

    from rlhfkit.data.collate import unpaired_collate
    from rlhfkit.models.moe import check_aux_loss_coef

    cfg.check_inputs()  # the flags were validated when parsed
    check_aux_loss_coef(cfg.train.aux_loss_coef, cfg.model.pretrain)
    run, reference = prepare_policy_and_reference(cfg, "kto", load_unpaired_datasets)
    t, strategy = cfg.train, run.strategy
    desirable = sum(int(s["label"]) for s in run.train)
    strategy.print(f"kto: beta {t.beta}, {len(run.train)} samples ({desirable} desirable), {run.steps} optimizer "
                   f"steps, world size {strategy.world_size}, {layout_name(cfg.strategy)}")
    collate = partial(unpaired_collate, pad_id=run.tokenizer.pad_token_id, packing=cfg.data.packing_samples,
                      kl_rows=True, max_len=cfg.data.max_len)
    trainer = KTOTrainer(strategy, run.engine, run.tokenizer, run.train, run.evalset, collate,
                         max_epochs=t.max_epochs, max_steps=t.max_steps, logging_args=cfg.logging,
                         ckpt_args=cfg.checkpoint, logger=run.logger, aux_loss_coef=t.aux_loss_coef,
                         reference=reference, beta=t.beta, desirable_loss_weight=t.desirable_loss_weight,
                         undesirable_loss_weight=t.undesirable_loss_weight, compute_fp32_loss=t.compute_fp32_loss,
                         packing=cfg.data.packing_samples, run=run.run)
    run.fit_and_save(trainer, cfg.checkpoint.save_path, "kto")
    return trainer


def labelled_logp_gap(model_or_path: Any, records: Sequence[Any], tokenizer: Any = None, *,
                      input_key: str = "prompt", output_key: str = "completion", label_key: str = "label",
                      input_template: str | None = None, apply_chat_template: bool = False, max_len: int = 512,
                      batch_size: int = 16) -> float:
    """Mean log pi(y|x) of the desirable completions minus that of the undesirable ones (KTO data), in-process.
    KTO should raise it."""
    from rlhfkit.data.collate import unpaired_collate
    from rlhfkit.data.preference_dataset import UnpairedDataset

    model = load_frozen_model(model_or_path)
    if tokenizer is None:
        from rlhfkit.models.loading import load_tokenizer

        tokenizer = load_tokenizer(tokenizer_source(model_or_path, model))
    data = UnpairedDataset(records, tokenizer, max_len, input_key=input_key, output_key=output_key,
                           label_key=label_key, input_template=input_template, apply_chat_template=apply_chat_template)
    device = next(model.parameters()).device
    totals = torch.zeros(2, 2, dtype=torch.float64)  # [desirable, undesirable] x [sum, count]
    with torch.no_grad():
        for start in range(0, len(data), batch_size):
            batch = unpaired_collate([data[i] for i in range(start, min(start + batch_size, len(data)))],
                                     pad_id=tokenizer.pad_token_id)
            batch = to_device(batch, device)
            logps = sequence_logps(model, batch)[0]
            for row, part in enumerate(by_label(logps, batch["labels"])):
                totals[row] += torch.tensor(part, dtype=torch.float64)
    means = totals[:, 0] / totals[:, 1].clamp(min=1)
    return float(means[0] - means[1])
