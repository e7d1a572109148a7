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

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from rlhfkit.algorithms.preference_losses import dpo_loss, nll_loss
from rlhfkit.algorithms.sft_loss import shifted_target_mask, token_logprobs
from rlhfkit.distributed.strategy import DeepSpeedStrategy
from rlhfkit.models.policy import attn_implementation_of, model_dtype, model_inputs
from rlhfkit.trainers.reward import PreferenceTrainer, Sums, pair_sums
from rlhfkit.trainers.sft import to_device


def per_sample_sums(values: torch.Tensor, mask: torch.Tensor,
                    sample_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of `values` [rows, T-1] under `mask` per sample, and the number of masked-in positions per sample.

    Padded batches: one sample per row -> [rows]. Packed batches: sample_ids [1, T] name the sample of every
    token; position t of `values` belongs to token t+1 -> [number of samples], in sample-id order."""
    mask = mask.to(values.dtype)
    if sample_ids is None:
        return (values * mask).sum(dim=-1), mask.sum(dim=-1)
    owner = sample_ids[:, 1:].reshape(-1).clamp(min=0)
    num_samples = int(sample_ids.max().item()) + 1
    flat_mask = mask.reshape(-1)
    sums = values.new_zeros(num_samples).index_add(0, owner, values.reshape(-1) * flat_mask)
    counts = values.new_zeros(num_samples).index_add(0, owner, flat_mask)
    return sums, counts


def sequence_logps(model: nn.Module, batch: dict[str, torch.Tensor], fp32: bool = False,
                   aux_loss: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(sum of response-token log-probs [n], response-token counts [n], MoE aux loss or None) of every sample of
    a padded or packed batch, from one forward pass. Log-probs are float32 (`token_logprobs`); `fp32` also runs
    the logits in float32 first."""
    inner = getattr(model, "module", model)
    inputs = model_inputs(batch, attn_implementation_of(inner), model_dtype(inner))
    aux_loss = aux_loss and hasattr(inner.config, "output_router_logits")  # mixture-of-experts models only
    if aux_loss:
        inputs["output_router_logits"] = True
    output = model(**inputs, use_cache=False)
    logits = output.logits[:, :-1]
    if fp32:
        logits = logits.float()
    sample_ids = batch.get("sample_ids")
    mask = shifted_target_mask(batch["loss_mask"], sample_ids)
    labels = batch["input_ids"][:, 1:].masked_fill(~mask, -100)  # token_logprobs gives 0 for a label < 0
    sums, counts = per_sample_sums(token_logprobs(logits, labels), mask, sample_ids)
    return sums, counts, getattr(output, "aux_loss", None) if aux_loss else None


def load_frozen_model(model_or_path: Any, value_head_prefix: str = "score") -> nn.Module:
    """An eval-mode, gradient-free model: a module as given, or a directory loaded as a reward model (when it
    was saved as a sequence classifier) or as a causal LM."""
    if isinstance(model_or_path, nn.Module):
        model = model_or_path
    else:
        from rlhfkit.models.loading import check_model_path, load_causal_lm
        from rlhfkit.models.value_model import load_value_model

        path = check_model_path(str(model_or_path), "model")
        with open(os.path.join(path, "config.json")) as f:
            architectures = json.load(f).get("architectures") or []
        if any(a.endswith("ForSequenceClassification") for a in architectures):
            model = load_value_model(path, value_head_prefix=value_head_prefix, flag="model")
        else:
            model = load_causal_lm(path, flag="model")
    model.requires_grad_(False)
    return model.eval()


class FrozenReference:
    """The frozen reference policy: log-probs without gradients, optionally parked on the CPU between uses."""

    def __init__(self, strategy: DeepSpeedStrategy, model: nn.Module, offload: bool = False, fp32: bool = False):
        self.strategy = strategy
        self.fp32 = fp32
        zero3 = strategy.args.zero_stage == 3
        # Under ZeRO-3 DeepSpeed itself keeps the parameter shards on the CPU (offload_param); otherwise the
        # whole module moves to the accelerator for each forward and back.
        self.move = offload and not zero3
        self.model = zero3_offloaded_eval(strategy, model) if offload and zero3 else strategy.prepare_eval(model)
        if self.move:
            self.model.to("cpu")

    @torch.no_grad()
    def logps(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        if self.move:
            self.model.to(self.strategy.device)
        try:
            sums, counts, _ = sequence_logps(self.model, batch, self.fp32)
        finally:
            if self.move:
                self.model.to("cpu")
        return sums, counts


def zero3_offloaded_eval(strategy: DeepSpeedStrategy, model: nn.Module) -> nn.Module:
    """A frozen ZeRO-3 inference engine whose parameter shards live on the CPU (DeepSpeed offload_param)."""
    import deepspeed

    model.requires_grad_(False)
    model.eval()
    config = strategy.ds_config(train=False)
    config["zero_optimization"]["offload_param"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    engine, _, _, _ = deepspeed.initialize(model=model, config=config, dist_init_required=False)
    return engine


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

    def train_step(self, batch: dict[str, torch.Tensor]) -> Sums:
        loss, sums = self.loss(batch)
        self.engine.backward(loss)
        self.engine.step()
        return sums

    def eval_step(self, batch: dict[str, torch.Tensor]) -> Sums:
        return self.loss(batch)[1]


def load_reference(cfg: Any, strategy: DeepSpeedStrategy, attn: str) -> FrozenReference:
    """The reference model of DPO/KTO: --ref_pretrain, else --pretrain."""
    from rlhfkit.models.loading import check_model_path, load_causal_lm

    flag = "--ref_pretrain" if cfg.reference.ref_pretrain else "--pretrain"
    path = check_model_path(cfg.reference.ref_pretrain or cfg.model.pretrain, flag)
    model = load_causal_lm(path, attn_implementation=attn, dtype=torch.float32, flag=flag)
    return FrozenReference(strategy, model, cfg.reference.ref_offload, cfg.train.compute_fp32_loss)


@dataclass
class PolicyAndReference:
    """What DPO and KTO assemble alike: the strategy, tokenizer and datasets, the trainable policy's engine with its
    optimizer-step count, the frozen reference and the metrics logger."""

    strategy: DeepSpeedStrategy
    tokenizer: Any
    train: Any
    evalset: Any
    steps: int
    engine: Any
    reference: FrozenReference
    logger: Any

    def fit_and_save(self, trainer: PreferenceTrainer, save_path: str, kind: str) -> None:
        """Train, save the policy as a Hugging Face model, close the logger whatever happens."""
        try:
            trainer.fit()
            self.strategy.save_hf_model(self.engine, self.tokenizer, save_path)
        finally:
            self.logger.close()
        self.strategy.print(f"{kind}: model saved to {save_path}; metrics in {self.logger.path}")


def prepare_policy_and_reference(cfg: Any, kind: str,
                                 load_datasets: Callable[[Any, Any], tuple[Any, Any]]) -> PolicyAndReference:
    """Check the model paths and data before any process group starts, then build the policy and the reference."""
    from rlhfkit.models.loading import check_model_path, resolve_attn_implementation
    from rlhfkit.trainers.reward import check_enough_samples
    from rlhfkit.trainers.setup import load_tokenizer_for, load_trainable_lm, make_logger, make_strategy

    strategy = make_strategy(cfg.model, cfg.strategy)
    attn = resolve_attn_implementation(cfg.model.attn_implementation, cfg.model.flash_attn)
    check_model_path(cfg.model.pretrain)
    if cfg.reference.ref_pretrain:
        check_model_path(cfg.reference.ref_pretrain, "--ref_pretrain")
    tokenizer = load_tokenizer_for(cfg.model)
    train, evalset = load_datasets(cfg, tokenizer)
    check_enough_samples(train, cfg.strategy.train_batch_size)
    strategy.setup_distributed()
    steps = (len(train) // cfg.strategy.train_batch_size) * cfg.train.max_epochs
    engine = strategy.prepare_train(load_trainable_lm(cfg.model), cfg.strategy.learning_rate, steps)
    reference = load_reference(cfg, strategy, attn)
    logger = make_logger(strategy, cfg.logging, cfg.checkpoint.save_path, kind, cfg)
    return PolicyAndReference(strategy, tokenizer, train, evalset, steps, engine, reference, logger)


def run_dpo(cfg: Any) -> DPOTrainer:
    """Assemble and run DPO/IPO/cDPO from a `DPOConfig`; saves the policy as a Hugging Face model."""
    from functools import partial

    from rlhfkit.config.preference import validate_dpo_config
    from rlhfkit.data.collate import pair_collate
    from rlhfkit.errors import UserError
    from rlhfkit.models.moe import check_aux_loss_coef
    from rlhfkit.trainers.reward import load_pair_datasets

    validate_dpo_config(cfg)
    if cfg.pairs.margin_key:
        raise UserError("--margin_key applies to train_rm only; DPO has no reward margin")
    check_aux_loss_coef(cfg.train.aux_loss_coef, cfg.model.pretrain, cfg.data.packing_samples)
    run = prepare_policy_and_reference(cfg, "dpo", load_pair_datasets)
    t, strategy = cfg.train, run.strategy
    method = "IPO" if t.ipo else ("cDPO" if t.label_smoothing > 0 else "DPO")
    strategy.print(f"dpo: {method}, beta {t.beta}, {len(run.train)} pairs, {run.steps} optimizer steps, world size "
                   f"{strategy.world_size}, ZeRO-{cfg.strategy.zero_stage}, gradient accumulation "
                   f"{strategy.accumulation_steps}")
    collate = partial(pair_collate, pad_id=run.tokenizer.pad_token_id, packing=cfg.data.packing_samples)
    trainer = DPOTrainer(strategy, run.engine, run.tokenizer, run.train, run.evalset, collate,
                         max_epochs=t.max_epochs, max_steps=t.max_steps, logging_args=cfg.logging,
                         ckpt_args=cfg.checkpoint, logger=run.logger, aux_loss_coef=t.aux_loss_coef,
                         reference=run.reference, beta=t.beta, label_smoothing=t.label_smoothing, ipo=t.ipo,
                         nll_loss_coef=t.nll_loss_coef, compute_fp32_loss=t.compute_fp32_loss)
    run.fit_and_save(trainer, cfg.checkpoint.save_path, "dpo")
    return trainer
