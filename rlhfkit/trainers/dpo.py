"""Direct preference optimisation of a policy against a frozen reference: DPO, cDPO, IPO, plus an NLL term.

The losses are `rlhfkit.algorithms.preference_losses.dpo_loss` (DPO: Rafailov et al. 2023, "Direct Preference
Optimization: Your Language Model is Secretly a Reward Model"; cDPO: Mitchell 2023, "A note on DPO with noisy
preferences"; IPO: Azar et al. 2023, "A General Theoretical Paradigm to Understand Learning from Human
Preferences") and `nll_loss` (RPO: Pang et al. 2024, "Iterative Reasoning Preference Optimization").

Per micro batch: chosen and rejected rows go through ONE forward pass of the policy and one of the reference
(`pair_collate`: chosen rows first); a sample's log-prob is the sum of its response-token log-probs (the loss
mask; packed rows are reduced by sample id). IPO uses the per-token mean instead, as the IPO paper does.
The reference is frozen (`strategy.prepare_eval`: a ZeRO-3 engine when --zero_stage 3) and, with --ref_offload,
kept on the CPU between forward passes.
"""

from __future__ import annotations

from typing import Any

import torch

from rlhfkit.algorithms.preference_losses import dpo_loss, nll_loss
from rlhfkit.config.preference import DPOConfig
from rlhfkit.trainers.offline import to_device
from rlhfkit.trainers.preference import (
    FrozenReference,
    PreferenceTrainer,
    Sums,
    load_pair_datasets,
    pair_sums,
    prepare_policy_and_reference,
    sequence_logps,
)


class DPOTrainer(PreferenceTrainer):
    kind = "dpo"

    def __init__(self, *args: Any, reference: FrozenReference, beta: float, label_smoothing: float = 0.0,
                 ipo: bool = False, nll_loss_coef: float = 0.0, compute_fp32_loss: bool = False, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.reference = reference
        self.beta = beta
        self.label_smoothing = label_smoothing
        self.ipo = ipo
        self.nll_loss_coef = nll_loss_coef
        self.fp32 = compute_fp32_loss

    def loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, Sums]:
        batch = to_device(batch, self.strategy.device)
        want_aux = self.aux_loss_coef > 0
        policy, counts, aux = sequence_logps(self.engine, batch, self.fp32, want_aux)
        ref, _ = self.reference.logps(batch)
        pairs = batch["margin"].numel()
        nll = nll_loss(policy[:pairs], counts[:pairs])
        if self.ipo:  # IPO's log-ratios are per-token means
            policy_score, ref_score = policy / counts.clamp(min=1), ref / counts.clamp(min=1)
        else:
            policy_score, ref_score = policy, ref
        preference, chosen_rewards, rejected_rewards = dpo_loss(
            policy_score[:pairs], policy_score[pairs:], ref_score[:pairs], ref_score[pairs:], self.beta,
            label_smoothing=self.label_smoothing, ipo=self.ipo)
        loss = preference
        if self.nll_loss_coef > 0:
            loss = loss + self.nll_loss_coef * nll
        if want_aux and aux is not None:
            loss = loss + self.aux_loss_coef * aux
        sums = pair_sums(preference.detach(), chosen_rewards, rejected_rewards)
        if want_aux and aux is not None:
            sums["aux_loss"] = (aux.item() * pairs, pairs)
        sums["preference_loss"] = sums["loss"]
        sums["loss"] = (loss.item() * pairs, pairs)
        sums["nll_loss"] = (nll.item() * pairs, pairs)
        sums["chosen_logps"] = (policy[:pairs].sum().item(), pairs)
        sums["rejected_logps"] = (policy[pairs:].sum().item(), pairs)
        return loss, sums


def run_dpo(cfg: DPOConfig) -> DPOTrainer:
    """Assemble and run DPO/IPO/cDPO from a `DPOConfig`; saves the policy as a Hugging Face model."""
    from functools import partial

    from rlhfkit.data.collate import pair_collate
    from rlhfkit.models.moe import check_aux_loss_coef

    cfg.check_inputs()  # the flags were validated when parsed
    check_aux_loss_coef(cfg.train.aux_loss_coef, cfg.model.pretrain)
    run, reference = prepare_policy_and_reference(cfg, "dpo", load_pair_datasets)
    t, strategy = cfg.train, run.strategy
    method = "IPO" if t.ipo else ("cDPO" if t.label_smoothing > 0 else "DPO")
    strategy.print(f"dpo: {method}, beta {t.beta}, {len(run.train)} pairs, {run.steps} optimizer steps, world size "
                   f"{strategy.world_size}, ZeRO-{cfg.strategy.zero_stage}, gradient accumulation "
                   f"{strategy.accumulation_steps}")
    collate = partial(pair_collate, pad_id=run.tokenizer.pad_token_id, packing=cfg.data.packing_samples)
    trainer = DPOTrainer(strategy, run.engine, run.tokenizer, run.train, run.evalset, collate,
                         max_epochs=t.max_epochs, max_steps=t.max_steps, logging_args=cfg.logging,
                         ckpt_args=cfg.checkpoint, logger=run.logger, aux_loss_coef=t.aux_loss_coef,
                         reference=reference, beta=t.beta, label_smoothing=t.label_smoothing, ipo=t.ipo,
                         nll_loss_coef=t.nll_loss_coef, compute_fp32_loss=t.compute_fp32_loss,
                         packing=cfg.data.packing_samples, run=run.run)
    run.fit_and_save(trainer, cfg.checkpoint.save_path, "dpo")
    return trainer
