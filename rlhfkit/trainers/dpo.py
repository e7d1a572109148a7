"""Direct preference optimisation of a policy: DPO, cDPO, IPO against a frozen reference, the reference-free SimPO
and ORPO, plus an NLL term.

The losses are `rlhfkit.algorithms.preference_losses.dpo_loss` (DPO: Rafailov et al. 2023, "Direct Preference
Optimization: Your Language Model is Secretly a Reward Model"; cDPO: Mitchell 2023, "A note on DPO with noisy
preferences"; IPO: Azar et al. 2023, "A General Theoretical Paradigm to Understand Learning from Human
Preferences"), `simpo_loss` (Meng et al. 2024, "SimPO: Simple Preference Optimization with a Reference-Free
Reward"), `orpo_loss` (Hong et al. 2024, "ORPO: Monolithic Preference Optimization without Reference Model") and
`nll_loss` (RPO: Pang et al. 2024, "Iterative Reasoning Preference Optimization"). SimPO and ORPO read only the
policy's per-token mean log-probs: no reference model is loaded or run for them.

Per micro batch: chosen and rejected rows go through ONE forward pass of the policy and one of the reference
(`pair_collate`: chosen rows first); a sample's log-prob is the sum of its response-token log-probs (the loss
mask; packed rows are reduced by sample id). IPO uses the per-token mean instead, as the IPO paper does.
The reference is frozen (`strategy.prepare_eval`: a ZeRO-3 engine when --zero_stage 3) and, with --ref_offload,
kept on the CPU between forward passes.
"""

from __future__ import annotations

from typing import Any

import torch

from rlhfkit.algorithms.preference_losses import dpo_loss, nll_loss, orpo_loss, simpo_loss
from rlhfkit.config.backend import layout_name
from rlhfkit.config.names import REFERENCE_FREE_DPO_LOSSES
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

    def __init__(self, *args: Any, reference: FrozenReference | None, beta: float, label_smoothing: float = 0.0,
                 ipo: bool = False, nll_loss_coef: float = 0.0, compute_fp32_loss: bool = False,
                 loss_type: str = "sigmoid", simpo_gamma: float = 0.5, **kwargs: Any):
        super().__init__(*args, **kwargs)
        if (reference is None) != (loss_type in REFERENCE_FREE_DPO_LOSSES):
            raise ValueError(f"loss_type {loss_type} needs {'no' if reference else 'a'} reference model")
        self.reference = reference
        self.loss_type = loss_type
        self.simpo_gamma = simpo_gamma
        self.beta = beta
        self.label_smoothing = label_smoothing
        self.ipo = ipo
        self.nll_loss_coef = nll_loss_coef
        self.fp32 = compute_fp32_loss

    def loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, Sums]:
        batch = to_device(batch, self.strategy.device)
        want_aux = self.aux_loss_coef > 0
        policy, counts, aux = sequence_logps(self.engine, batch, self.fp32, want_aux)
        pairs = batch["margin"].numel()
        nll = nll_loss(policy[:pairs], counts[:pairs])
        preference, chosen_rewards, rejected_rewards = self.preference_loss(batch, policy, counts, pairs)
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

    def preference_loss(self, batch: dict[str, torch.Tensor], policy: torch.Tensor, counts: torch.Tensor,
                        pairs: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(loss, chosen rewards, rejected rewards) of the pairs: rows [:pairs] are chosen, [pairs:] rejected."""
        mean = policy / counts.clamp(min=1)  # per-token mean log-probs: SimPO, ORPO and IPO read these
        if self.loss_type == "simpo":
            return simpo_loss(mean[:pairs], mean[pairs:], self.beta, self.simpo_gamma)
        if self.loss_type == "orpo":
            return orpo_loss(mean[:pairs], mean[pairs:], self.beta)
        assert self.reference is not None  # checked in __init__
        ref, _ = self.reference.logps(batch)
        if self.ipo:  # IPO's log-ratios are per-token means
            policy_score, ref_score = mean, ref / counts.clamp(min=1)
        else:
            policy_score, ref_score = policy, ref
        return dpo_loss(policy_score[:pairs], policy_score[pairs:], ref_score[:pairs], ref_score[pairs:], self.beta,
                        label_smoothing=self.label_smoothing, ipo=self.ipo)


def method_name(cfg: DPOConfig) -> str:
    """The loss a run trains with, for its start-up line."""
    t = cfg.train
    if t.loss_type == "simpo":
        return f"SimPO (gamma {t.simpo_gamma}, no reference model)"
    if t.loss_type == "orpo":
        return "ORPO (no reference model)"
    return "IPO" if t.ipo else ("cDPO" if t.label_smoothing > 0 else "DPO")


def run_dpo(cfg: DPOConfig) -> DPOTrainer:
    """Assemble and run DPO/IPO/cDPO/SimPO/ORPO from a `DPOConfig`; saves the policy as a Hugging Face model."""
    from functools import partial

    from rlhfkit.data.collate import pair_collate
    from rlhfkit.models.moe import check_aux_loss_coef
    from rlhfkit.run.setup import assemble_offline

    cfg.check_inputs()  # the flags were validated when parsed
    check_aux_loss_coef(cfg.train.aux_loss_coef, cfg.model.pretrain)
    t = cfg.train
    reference: FrozenReference | None = None
    if t.loss_type in REFERENCE_FREE_DPO_LOSSES:  # SimPO / ORPO: the policy alone (the config refuses --ref_*)
        run = assemble_offline(cfg, "dpo", load_pair_datasets)
    else:
        run, reference = prepare_policy_and_reference(cfg, "dpo", load_pair_datasets)
    strategy = run.strategy
    strategy.print(f"dpo: {method_name(cfg)}, beta {t.beta}, {len(run.train)} pairs, {run.steps} optimizer steps, "
                   f"world size {strategy.world_size}, {layout_name(cfg.strategy)}, gradient accumulation "
                   f"{strategy.accumulation_steps}")
    collate = partial(pair_collate, pad_id=run.tokenizer.pad_token_id, packing=cfg.data.packing_samples)
    trainer = DPOTrainer(strategy, run.engine, run.tokenizer, run.train, run.evalset, collate,
                         max_epochs=t.max_epochs, max_steps=t.max_steps, logging_args=cfg.logging,
                         ckpt_args=cfg.checkpoint, logger=run.logger, aux_loss_coef=t.aux_loss_coef,
                         reference=reference, beta=t.beta, label_smoothing=t.label_smoothing, ipo=t.ipo,
                         nll_loss_coef=t.nll_loss_coef, compute_fp32_loss=t.compute_fp32_loss,
                         loss_type=t.loss_type, simpo_gamma=t.simpo_gamma,
                         packing=cfg.data.packing_samples, run=run.run)
    run.fit_and_save(trainer, cfg.checkpoint.save_path, "dpo")
    return trainer
