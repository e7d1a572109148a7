"""The model roles of an RL step as plain local objects: actor, critic, reference, reward model.

The RL loop talks to a role only through the methods below, with CPU tensors, lists, dicts and numbers in and out,
so the same loop drives these objects in one process or a Ray actor group wrapping them (one object per rank).
Their interfaces are the Protocols of `role_protocols.py`. How a group dispatches a method over its ranks is
declared on the method (`@dispatch("split")`, read by `rlhfkit/distributed/ray_groups.py`):
- "split" (rows spread over ranks, results concatenated): the scoring forwards `log_probs`, `values`, `score`;
- "broadcast", the default (every rank gets the same call, as collectives need): `train` (each rank takes its own
  micro-batches, `replay_buffer.py`), `state_dict` and the saves and loads. The forwards are in `role_forward.py`.
A batch is an `Experience` or its `to_dict()`; action tensors come back as [B, R] matching the batch's R.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from rlhfkit.algorithms.masking import aggregate_loss, masked_mean
from rlhfkit.algorithms.policy_loss import policy_loss, value_loss
from rlhfkit.config.specs import CRITIC_HEAD_HINT, ActorSpec, CriticSpec, ReferenceSpec, RewardSpec, RoleSpec
from rlhfkit.distributed.accumulation import mark_accumulation_boundary
from rlhfkit.distributed.nonfinite import NonFiniteGuard
from rlhfkit.distributed.ray_groups import dispatch
from rlhfkit.distributed.startup_clock import mark
from rlhfkit.distributed.universal import load_engine_state, save_engine_state
from rlhfkit.errors import UserError
from rlhfkit.models.ema import ParameterEMA
from rlhfkit.models.loading import check_model_path, load_causal_lm, resolve_attn_implementation
from rlhfkit.models.moe import router_aux_loss
from rlhfkit.models.value_model import load_value_model
from rlhfkit.models.vision import frozen_vision_names
from rlhfkit.rl.actor_losses import distill_term, kl_loss_term
from rlhfkit.rl.experience import Experience, as_experience
from rlhfkit.rl.replay_buffer import OptimizerStep, ReplayBuffer, one_optimizer_step
from rlhfkit.rl.role_forward import (
    action_log_probs,
    action_values,
    actor_forward,
    hf_state_dict,
    per_chunk,
    reused_old_log_probs,
    sample_rewards,
)
from rlhfkit.run.setup import build_strategy, load_tokenizer_for, load_trainable_lm

Stats = dict[str, float | tuple[float, float]]  # a micro-step's stats; a (value, weight) pair brings its own weight


def _field(tensor: torch.Tensor | None, name: str) -> torch.Tensor:
    """An experience field a training step needs (`train` checked the whole experience has it)."""
    if tensor is None:
        raise ValueError(f"the micro-batch has no {name}")
    return tensor


def _dtype(spec: RoleSpec) -> torch.dtype:
    return torch.bfloat16 if spec.model.bf16 else torch.float32


def _attn(spec: RoleSpec) -> str:
    return resolve_attn_implementation(spec.model.attn_implementation, spec.model.flash_attn)


class _Role:
    """What every role has: its spec, its strategy in this rank's process group, packed forwards or not."""

    name = "role"

    def __init__(self, spec: RoleSpec):
        self.spec = spec
        self.packed = spec.batch.packed  # forwards on packed rows (docs/CONVENTIONS.md)
        self.strategy = build_strategy(spec.model, spec.strategy)


class _TrainedRole(_Role):
    """What actor and critic share: a DeepSpeed training engine, weighted metrics, saving, checkpoints."""

    def __init__(self, spec: RoleSpec):
        super().__init__(spec)
        self.engine: Any = None
        self._micro_weight = 1.0
        self.tokenizer = load_tokenizer_for(spec.model)

    @property
    def device(self) -> torch.device:
        return self.strategy.device

    def _buffer(self, exp: Experience, seed: int) -> ReplayBuffer:
        b = self.spec.batch
        return ReplayBuffer(exp, b.train_batch_size, b.micro_train_batch_size, rank=self.strategy.dp_rank,
                            world_size=self.strategy.dp_world_size, seed=seed, max_tokens=b.max_tokens_per_gpu,
                            packed=self.packed)

    def _reduce(self, sums: dict[str, float], weights: dict[str, float]) -> dict[str, float]:
        """Weighted means over every micro-batch of every rank."""
        keys = sorted(sums)
        if not keys:
            return {}
        totals = self.strategy.all_reduce(torch.tensor([sums[k] for k in keys], dtype=torch.float64), "sum")
        counts = self.strategy.all_reduce(torch.tensor([weights[k] for k in keys], dtype=torch.float64), "sum")
        return {k: float(t / max(c, 1e-12)) for k, t, c in zip(keys, totals.tolist(), counts.tolist())}

    def _step_scale(self, tokens: int, rows: int, agg: str, step_tokens: int, step_rows: int) -> float:
        """Factor turning a micro-batch mean into its share of the optimizer step's mean (see replay_buffer.py).

        DeepSpeed averages gradients over ranks, hence the data-parallel world in the denominator: the ranks of a
        sequence-parallel group share each micro-batch and their gradients add up to P x its own."""
        world = self.strategy.dp_world_size
        if agg == "token_mean":  # a step whose every episode failed before sampling has no action token at all
            return tokens / (max(step_tokens, 1) / world)
        return rows / (step_rows / world)

    def _backward_step(self, loss: torch.Tensor) -> None:
        # The loss is already normalised over the whole optimizer step: no extra 1/accumulation scaling. A filler
        # micro-batch (token budget, see replay_buffer.py) only joins the collectives: weight 0.
        self.engine.backward(loss * self._micro_weight, scale_wrt_gas=False)
        self.engine.step()

    def _train_epochs(self, exp: Experience, seed: int,
                      micro_step: Callable[[Experience, OptimizerStep], tuple[Stats, float]]
                      ) -> dict[str, float]:
        """--max_epochs passes over the experience in optimizer steps. `micro_step(micro, step)` runs forward,
        backward and step on one micro batch and returns its stats with their weight; the result is the weighted
        mean of every stat over every micro batch of every rank (weighted by `weight`, or by the stat's own weight
        when `micro_step` gives it as a (value, weight) pair), the mean grad norm and the learning rate."""
        sums: dict[str, float] = defaultdict(float)
        weights: dict[str, float] = defaultdict(float)
        buffer = self._buffer(exp, seed)
        if getattr(self, "nonfinite", None) is None:  # created after a resume restored the engine's counters
            self.nonfinite = NonFiniteGuard(self.spec.strategy.max_nonfinite_steps, type(self).__name__)
            self.nonfinite.watch(self.engine)
            self.optimizer_steps = 0
        self.engine.train()
        for epoch in range(self.spec.batch.max_epochs):
            for step in buffer.epoch(epoch):
                for k, micro in enumerate(step.micro_batches):
                    mark_accumulation_boundary(self.engine, k == len(step.micro_batches) - 1,
                                               self.spec.strategy.use_dynamic_batch)
                    self._micro_weight = 1.0 if step.is_real(k) else 0.0
                    stats, weight = micro_step(micro.to(self.device), step)
                    for name, v in stats.items():
                        v, w = v if isinstance(v, tuple) else (v, weight)  # a stat may bring its own weight
                        sums[name] += v * w * self._micro_weight
                        weights[name] += w * self._micro_weight
                self._micro_weight = 1.0
                self.optimizer_steps += 1
                skipped_before = self.nonfinite.total
                self.nonfinite.after_step(self.optimizer_steps, self.engine)  # raises after too many in a row
                self._after_optimizer_step()
                norm = self.engine.get_global_grad_norm()
                if norm is not None and self.nonfinite.total == skipped_before:
                    sums["grad_norm"] += float(norm)
                    weights["grad_norm"] += 1
        metrics = self._reduce(sums, weights)
        metrics["lr"] = float(self.engine.get_lr()[0])
        metrics["nonfinite_skipped"] = float(self.nonfinite.total)
        return metrics

    def _after_optimizer_step(self) -> None:
        """Hook run once per optimizer step (the actor's EMA)."""

    # -- saving ---------------------------------------------------------------------------------------------
    def save_hf_model(self, path: str) -> None:
        """A Transformers model directory (with the tokenizer) that plain `from_pretrained` loads."""
        self.strategy.save_hf_model(self.engine, self.tokenizer, path)

    def save_checkpoint(self, save_dir: str, tag: str, save_latest: bool = False) -> None:
        """DeepSpeed engine states (weights, optimizer, schedule) under save_dir/tag (same signature as an engine,
        so `rlhfkit.run.checkpoint.save_checkpoint` takes the role itself); layout-free with
        --use_ds_universal_ckpt."""
        save_engine_state(self.engine, save_dir, tag, self.spec.universal_ckpt,
                          self.strategy.is_rank0)

    def load_checkpoint(self, load_dir: str, tag: str) -> tuple[str | None, Any]:
        return (load_dir if load_engine_state(self.engine, load_dir, tag) else None), None


class ActorRole(_TrainedRole):
    """The policy being trained: old log-probs for the rollout, PPO updates, weights for the engines."""

    name = "actor"
    spec: ActorSpec

    def __init__(self, spec: ActorSpec, num_update_steps: int):
        super().__init__(spec)
        model = load_trainable_lm(spec.model)
        mark("model_loaded")  # the rest of the role's start-up is the strategy's (DeepSpeed) set-up
        self.frozen_names = frozen_vision_names(model) if spec.freeze_visual_encoder else frozenset()  # never synced
        self.engine = self.strategy.prepare_train(model, spec.learning_rate, num_update_steps)
        self.temperature = spec.temperature
        self.agg = spec.loss_agg
        self.ema = ParameterEMA(self.strategy.unwrap(self.engine), spec.ema_beta) if spec.ema_beta is not None \
            else None

    @dispatch("split")
    @torch.no_grad()
    def log_probs(self, batch: Experience | dict[str, Any]) -> torch.Tensor:
        """[B, R] log-probs of the response tokens under the current policy (PPO's old policy)."""
        exp = as_experience(batch)
        self.engine.eval()
        try:
            return per_chunk(exp, self.spec.batch, self.strategy,
                             lambda e: action_log_probs(self.engine, e, self.temperature, self.packed))
        finally:
            self.engine.train()

    def train(self, batch: Experience | dict[str, Any], kl_coef: float = 0.0, seed: int = 0,
              entropy_metric: bool = True) -> dict[str, float]:
        """--max_epochs passes of PPO updates over the experience; returns the step's actor metrics.

        Without `action_log_probs` the experience must make exactly one optimizer step: the policy has then not
        moved since the rollout, so the old log-probs are the current ones (`reused_old_log_probs`). The entropy
        is computed when it is in the loss or `entropy_metric` asks for the metric (a step that is logged)."""
        exp = as_experience(batch)
        if exp.advantages is None:
            raise ValueError("ActorRole.train needs advantages in the experience")
        one_step = one_optimizer_step(len(exp), self.spec.batch.train_batch_size, self.spec.batch.max_epochs)
        if exp.action_log_probs is None and not one_step:
            raise ValueError("ActorRole.train without action_log_probs needs one optimizer step per rollout "
                             "(max_epochs 1 and train_batch_size == the experience's samples)")
        return self._train_epochs(exp, seed, lambda micro, step: self._micro_step(micro, step, kl_coef,
                                                                                   entropy_metric))

    def _micro_step(self, micro: Experience, step: OptimizerStep, kl_coef: float,
                    entropy_metric: bool = True) -> tuple[Stats, float]:
        a = self.spec
        mask = micro.action_mask
        want_entropy = "loss" if a.entropy_loss_coef > 0 else "metric" if entropy_metric else None
        with router_aux_loss(self.engine, a.aux_loss_coef > 0) as aux:
            logits, logp, entropy = actor_forward(self.engine, micro, self.temperature, self.packed, want_entropy)
        reused_stats: dict[str, tuple[float, float]] = {}
        if micro.action_log_probs is None:
            micro.action_log_probs, reused_stats = reused_old_log_probs(logp, micro, a.kl_estimator)
        agg_kwargs = {"norm_len": a.loss_norm_len} if a.loss_norm_len is not None else {}
        tis = a.is_correction and micro.rollout_log_probs is not None
        loss, info = policy_loss(logp, micro.action_log_probs, _field(micro.advantages, "advantages"), mask,
                                 clip_eps_low=a.clip_low,
                                 clip_eps_high=a.clip_high, dual_clip=a.dual_clip,
                                 rollout_logp=micro.rollout_log_probs if tis else None,
                                 tis_cap=a.is_high if tis else None, is_correction=a.is_correction_type,
                                 is_low=a.is_low, loss_type=a.policy_loss_type, tau_pos=a.tau_pos,
                                 tau_neg=a.tau_neg, agg=self.agg, **agg_kwargs)
        stats = {"policy_loss": loss.item(), **{k: v.item() for k, v in info.items()}, **reused_stats}
        total = torch.zeros_like(loss) if a.distill_only else loss  # --distill_only: no policy-gradient term
        for coef, (term, term_stats) in ((kl_coef, kl_loss_term(a, logp, micro, self.agg, agg_kwargs)), (
                a.distill_coef, distill_term(a, logits, logp, micro, self.agg, agg_kwargs))):
            if term is not None:
                total = total + coef * term
            stats.update(term_stats)
        if entropy is not None and a.entropy_loss_coef > 0:
            total = total - a.entropy_loss_coef * aggregate_loss(entropy, mask, self.agg, **agg_kwargs)
        if entropy is not None:
            stats["entropy"] = masked_mean(entropy.detach(), mask).item()
        if aux:  # MoE router load balancing (rlhfkit.models.moe)
            total = total + a.aux_loss_coef * aux[0]
            stats["aux_loss"] = aux[0].item()
        stats["loss"] = total.item()
        tokens, rows = int(mask.sum()), mask.shape[0]
        self._backward_step(total * self._step_scale(tokens, rows, self.agg, step.num_tokens, step.num_seqs))
        return stats, float(tokens)

    def state_dict(self) -> dict[str, torch.Tensor] | None:
        """The policy weights (Transformers names, CPU) for the engines (--freeze_visual_encoder: the LM's only)."""
        state = hf_state_dict(self.strategy, self.engine)
        return {k: v for k, v in state.items() if k not in self.frozen_names} if state is not None else None

    def _after_optimizer_step(self) -> None:
        if self.ema is not None:
            self.ema.update(self.strategy.unwrap(self.engine))

    def save_hf_model(self, path: str) -> None:
        """The policy as a Transformers model directory; with --enable_ema the averaged weights."""
        if self.ema is None:
            super().save_hf_model(path)
            return
        with self.ema.swapped_in(self.strategy.unwrap(self.engine)):
            super().save_hf_model(path)

    def _ema_path(self, save_dir: str, tag: str) -> str:
        return os.path.join(save_dir, tag, f"actor_ema_rank{self.strategy.rank}.pt")

    def save_checkpoint(self, save_dir: str, tag: str, save_latest: bool = False) -> None:
        super().save_checkpoint(save_dir, tag, save_latest)
        if self.ema is not None:
            path = self._ema_path(save_dir, tag)
            os.makedirs(os.path.dirname(path), exist_ok=True)  # (a save may not have made the tag folder yet)
            torch.save(self.ema.state_dict(), path)
        if self.spec.save_hf_ckpt:
            self.save_hf_model(f"{save_dir}/{tag}_hf")

    def load_checkpoint(self, load_dir: str, tag: str) -> tuple[str | None, Any]:
        path, client_state = super().load_checkpoint(load_dir, tag)
        if self.ema is not None:
            ema_file = self._ema_path(load_dir, tag)
            if not os.path.exists(ema_file):
                raise UserError(f"--enable_ema: the checkpoint {load_dir}/{tag} holds no EMA weights ({ema_file}); "
                                "resume without --enable_ema or from a checkpoint saved with it")
            self.ema.load_state_dict(torch.load(ema_file, map_location="cpu", weights_only=True))
        return path, client_state


class CriticRole(_TrainedRole):
    """The value model of PPO (`--advantage_estimator gae`): values for GAE, regression on the returns."""

    name = "critic"
    spec: CriticSpec

    def __init__(self, spec: CriticSpec, num_update_steps: int):
        super().__init__(spec)
        path = check_model_path(spec.path, "--critic_pretrain")
        model = load_value_model(path, value_head_prefix=spec.value_head_prefix,
                                 attn_implementation=_attn(spec), dtype=torch.float32, flag="--critic_pretrain",
                                 require_head=spec.require_head, allow_hint=CRITIC_HEAD_HINT)
        self.engine = self.strategy.prepare_train(model, spec.learning_rate, num_update_steps)

    def _values(self, exp: Experience) -> torch.Tensor:
        return action_values(self.engine, exp, self.packed)

    @dispatch("split")
    @torch.no_grad()
    def values(self, batch: Experience | dict[str, Any]) -> torch.Tensor:
        """[B, R] the value of the state before each response token."""
        exp = as_experience(batch)
        self.engine.eval()
        try:
            return per_chunk(exp, self.spec.batch, self.strategy, self._values)
        finally:
            self.engine.train()

    def train(self, batch: Experience | dict[str, Any], seed: int = 0) -> dict[str, float]:
        """--max_epochs passes of (clipped) value regression on the returns; returns the critic metrics."""
        exp = as_experience(batch)
        if exp.returns is None or exp.values is None:
            raise ValueError("CriticRole.train needs values and returns in the experience")
        return self._train_epochs(exp, seed, self._micro_step)

    def _micro_step(self, micro: Experience, step: OptimizerStep) -> tuple[Stats, float]:
        mask = micro.action_mask
        loss, info = value_loss(self._values(micro), _field(micro.values, "values"), _field(micro.returns, "returns"),
                                mask, value_clip=self.spec.value_clip)
        tokens = int(mask.sum())
        self._backward_step(loss * self._step_scale(tokens, mask.shape[0], "token_mean", step.num_tokens,
                                                    step.num_seqs))
        return {"value_loss": loss.item(), **{k: v.item() for k, v in info.items()}}, float(tokens)


class ReferenceRole(_Role):
    """The frozen initial policy: reference log-probs for the KL penalty or KL loss."""

    name = "ref"
    spec: ReferenceSpec

    def __init__(self, spec: ReferenceSpec):
        super().__init__(spec)
        model = load_causal_lm(check_model_path(spec.path), attn_implementation=_attn(spec), dtype=_dtype(spec))
        self.model = self.strategy.prepare_eval(model, shard_fsdp2=True)
        self.temperature = spec.temperature

    @dispatch("split")
    @torch.no_grad()
    def log_probs(self, batch: Experience | dict[str, Any]) -> torch.Tensor:
        exp = as_experience(batch)
        return per_chunk(exp, self.spec.batch, self.strategy,
                          lambda e: action_log_probs(self.model, e, self.temperature, self.packed))


class RewardModelRole(_Role):
    """A trained reward model (`--reward_pretrain`): the value head at each sample's last token."""

    name = "reward"
    spec: RewardSpec

    def __init__(self, spec: RewardSpec):
        super().__init__(spec)
        path = check_model_path(spec.path, "--reward_pretrain")
        model = load_value_model(path, value_head_prefix=spec.value_head_prefix,
                                 attn_implementation=_attn(spec), dtype=_dtype(spec), flag="--reward_pretrain")
        self.model = self.strategy.prepare_eval(model, shard_fsdp2=True)
        self.normalize = spec.normalize

    @dispatch("split")
    @torch.no_grad()
    def score(self, batch: Experience | dict[str, Any]) -> dict[str, Any]:
        """{"rewards": [B], "scores": [B], "extra_logs": {}}; the batch's text fields and image references are
        ignored (the model reads the token ids and the experience's pixels)."""
        texts = ("queries", "prompts", "labels", "image_refs")
        exp = as_experience({k: v for k, v in batch.items() if k not in texts}) if isinstance(batch, dict) else batch
        rewards = per_chunk(exp, self.spec.batch, self.strategy,
                             lambda e: sample_rewards(self.model, e, self.packed, self.normalize),
                             action_width=False)
        return {"rewards": rewards, "scores": rewards.clone(), "extra_logs": {}}
