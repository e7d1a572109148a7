"""The forward passes of the RL roles (`roles.py`), as plain functions of a model and an `Experience`: action
log-probs and logits (padded or packed rows, the LM head only where actions are), critic values, reward-model
scores, micro-batched over a rank's share with the same number of forwards on every rank; plus the actor's reused
old log-probs and its weights under Transformers names.

With sequence parallelism (--ring_attn_size) the ranks of a group hold the same rows and each runs a slice of every
row's tokens (`rlhfkit.models.sequence_parallel`): action log-probs and entropies come back whole on every rank of
the group (`sp_action_stats`); critic values and rewards take the same route inside `token_values`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from rlhfkit.algorithms.kl import compute_approx_kl
from rlhfkit.algorithms.logprobs import entropy_from_logits, token_logprobs
from rlhfkit.algorithms.masking import masked_mean
from rlhfkit.config.specs import BatchSpec
from rlhfkit.data.token_budget import plan_micro_batches
from rlhfkit.distributed.strategy import DeepSpeedStrategy
from rlhfkit.models.policy import attn_implementation_of, model_dtype, model_inputs
from rlhfkit.models.sequence_parallel import sequence_parallel_next_token_stats, sequence_parallel_size
from rlhfkit.models.shared_prefix import share_prefixes, shared_prefix_logits
from rlhfkit.models.trimmed_forward import trimmed_forward
from rlhfkit.models.value_model import sequence_rewards, token_values
from rlhfkit.rl.experience import Experience, gather_actions, pad_columns


def per_chunk(exp: Experience, batch: BatchSpec, strategy: DeepSpeedStrategy,
              fn: Callable[[Experience], torch.Tensor], action_width: bool = True) -> torch.Tensor:
    """Run `fn` over micro-batches of --micro_rollout_batch_size rows (or, with --use_dynamic_batch, of at most
    --rollout_max_tokens_per_gpu, else --max_tokens_per_gpu, tokens) and stitch the CPU results back in row order
    ([B, R] or [B]).

    Every rank runs as many forwards as the busiest one (repeating its first micro-batch), because under ZeRO-3 a
    forward is a collective."""
    budget = batch.scoring_max_tokens_per_gpu or batch.max_tokens_per_gpu  # --rollout_max_tokens_per_gpu's first
    if budget is not None:
        lengths = exp.attention_mask.sum(dim=1).tolist()
        chunks = plan_micro_batches(lengths, budget, widths=None if batch.packed else lengths)[0]
    else:
        size = batch.micro_rollout_batch_size
        chunks = [list(range(i, min(i + size, len(exp)))) for i in range(0, len(exp), size)]
    chunks = [c for c in chunks if c]
    outs = []
    for rows in chunks:
        out = fn(exp.select(rows).trimmed().to(strategy.device)).detach().float().cpu()
        outs.append(pad_columns(out, exp.num_actions) if action_width else out)
    if strategy.world_size > 1:
        for _ in range(int(strategy.all_reduce(len(chunks), "max")) - len(chunks)):
            fn(exp.select(chunks[0]).trimmed().to(strategy.device))
    order = torch.tensor([i for rows in chunks for i in rows], dtype=torch.long)
    result = torch.cat(outs, dim=0)
    return result[torch.argsort(order)]


def action_logits(model: Any, exp: Experience, packed: bool = False) -> torch.Tensor:
    """Logits [B, R, V] at the positions that predict each response token.

    The LM head and the last decoder layer run only from the first to the last position that holds an action
    (`trimmed_forward`), not over every prompt position: for a small model with a large vocabulary the head is
    most of the forward's work. With `packed` (`--packing_samples`) the rows go through the model as one packed
    row without their padding, and the logits come back in the padded [B, R] layout (zero where action_mask is 0).
    Where samples repeat a prompt (n samples per prompt), each prompt runs once and its KV cache is shared
    (`rlhfkit.models.shared_prefix`).
    """
    if packed:
        return _packed_action_logits(model, exp)
    # image rows: their forward needs the images (and M-RoPE positions), which the shared-prefix pass does not take
    groups = share_prefixes(model, exp.sequences, exp.attention_mask, exp.prompt_lengths) if not exp.images else None
    if groups is not None:
        return shared_prefix_logits(model, exp.sequences, exp.attention_mask, exp.prompt_lengths, exp.num_actions,
                                    groups)
    positions = exp.action_positions()
    first, last = int(positions.min()), int(positions.max())
    keep = torch.arange(first, last + 1, device=positions.device)
    inputs = model_inputs(exp.model_inputs(), attn_implementation_of(model), model_dtype(model))
    logits = trimmed_forward(model, keep, **inputs, use_cache=False)
    return gather_actions(logits, positions - first)


def _packed_action_logits(model: Any, exp: Experience) -> torch.Tensor:
    batch, index = exp.packed_inputs()
    mask = exp.action_mask.bool()
    keep = index[mask]  # increasing: rows are packed in order, actions in order within a row
    inputs = model_inputs(batch, attn_implementation_of(model), model_dtype(model))
    logits = trimmed_forward(model, keep, **inputs, use_cache=False)[0]
    out = logits.new_zeros(*mask.shape, logits.shape[-1])
    out[mask] = logits
    return out


def action_log_probs(model: Any, exp: Experience, temperature: float, packed: bool = False) -> torch.Tensor:
    """log softmax(logits / temperature) of each response token, [B, R] (the rollout engine's convention)."""
    return actor_forward(model, exp, temperature, packed)[1]


def actor_forward(model: Any, exp: Experience, temperature: float, packed: bool = False, entropy: str | None = None
                  ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    """The actor's forward: (logits / temperature [B, R, V], or None under sequence parallelism, where no rank
    holds a whole row's logits; log-probs [B, R]; with `entropy` ("metric": no gradient, "loss") the entropy [B, R])."""
    if sequence_parallel_size() > 1:
        return None, *sp_action_stats(model, exp, temperature, packed, entropy)
    logits = action_logits(model, exp, packed)
    if temperature != 1.0:
        logits = logits / temperature
    logp = token_logprobs(logits, exp.action_tokens())
    if entropy == "loss":
        return logits, logp, entropy_from_logits(logits)
    if entropy == "metric":
        with torch.no_grad():
            return logits, logp, entropy_from_logits(logits.detach())
    return logits, logp, None


def sp_action_stats(model: Any, exp: Experience, temperature: float, packed: bool, entropy: str | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Sequence parallelism: [B, R] log-probs (and entropies) of the response tokens, the group's ranks each
    running a slice of the rows' tokens (padded rows, or the rows packed into one without their padding)."""
    if packed:
        batch, index = exp.packed_inputs()
        logp, ent = sequence_parallel_next_token_stats(model, batch, temperature, entropy)
        return logp[0][index], None if ent is None else ent[0][index]
    positions = exp.action_positions()
    logp, ent = sequence_parallel_next_token_stats(model, exp.model_inputs(), temperature, entropy)
    return gather_actions(logp, positions), None if ent is None else gather_actions(ent, positions)


def action_values(model: Any, exp: Experience, packed: bool = False) -> torch.Tensor:
    """The critic's value [B, R] of the state before each response token (padded or packed forward)."""
    if packed:
        batch, index = exp.packed_inputs()
        return token_values(model, batch)[0][index]
    return gather_actions(token_values(model, exp.model_inputs()), exp.action_positions())


def sample_rewards(model: Any, exp: Experience, packed: bool = False, normalize: bool = False) -> torch.Tensor:
    """The reward model's score [B] of each sample, read at its last real token (padded or packed forward)."""
    batch = exp.packed_inputs()[0] if packed else exp.model_inputs()
    return sequence_rewards(model, batch, normalize=normalize)


def reused_old_log_probs(logp: torch.Tensor, micro: Experience, kl_estimator: str
                         ) -> tuple[torch.Tensor, dict[str, tuple[float, float]]]:
    """Old log-probs when the policy has not moved since the rollout: the current ones, detached (exactly what an
    extra no-grad forward would give, without that forward). Also the scoring metrics the RL loop computes from
    old log-probs otherwise, each with its weight: `old_kl` (per-sample mean KL to the reference, a mean over
    samples) and `old_rollout_logprob_diff` (a mean over response tokens)."""
    old = logp.detach()
    mask = micro.action_mask
    stats: dict[str, tuple[float, float]] = {}
    if micro.rollout_log_probs is not None:
        diff = masked_mean((old - micro.rollout_log_probs).abs(), mask)
        stats["old_rollout_logprob_diff"] = (float(diff), float(mask.sum()))
    if micro.base_action_log_probs is not None:
        kl = compute_approx_kl(old, micro.base_action_log_probs, kl_estimator, mask)
        stats["old_kl"] = (float(masked_mean(kl, mask, dim=-1).mean()), float(mask.shape[0]))
    return old, stats


def hf_state_dict(strategy: DeepSpeedStrategy, engine: Any) -> dict[str, torch.Tensor] | None:
    """The policy's weights under Transformers names (LoRA merged in), on CPU; None off rank 0."""
    module: Any = strategy.unwrap(engine)  # a Transformers or PEFT model (nn.Module types its methods badly)
    if not hasattr(module, "peft_config"):
        return strategy.full_state_dict(engine)
    module.merge_adapter()
    try:
        return {k.replace("base_model.model.", "", 1).replace(".base_layer", ""): v.detach().cpu().clone()
                for k, v in module.state_dict().items() if "lora_" not in k}
    finally:
        module.unmerge_adapter()
