"""Sequence parallelism: one sample's tokens split over the ranks of a group, attention exact over the whole sample.

DeepSpeed-Ulysses (Jacobs et al. 2023, "DeepSpeed Ulysses: System Optimizations for Enabling Training of Extreme
Long Sequence Transformer Models"). Each of the P ranks of a sequence-parallel group holds a contiguous slice of
T/P tokens and runs every layer on it. Only attention needs the other tokens: one all-to-all turns each rank's
[heads, T/P] queries, keys and values into [heads/P, T] (every token, a 1/P share of the heads), torch's
scaled_dot_product_attention runs on whole sequences with the sample's full mask, and a second all-to-all returns
[heads, T/P]. The result is the one-rank attention up to float summation order, so the losses and gradients match a
one-rank run; the all-to-alls' backward is the reverse all-to-all.

Why Ulysses and not ring attention: ring attention (ring-flash-attn, OpenRLHF's choice) needs flash-attention's
CUDA kernels for its blockwise softmax; an all-to-all of heads runs on gloo and torch's sdpa, so the same code is
exact on CPU and GPU. The cost: the head count must split over the group (--ring_attn_size divides the query
heads; key/value heads that do not split are repeated first). Attention runs one causal call per sample
(`segment_attention`), so no rank builds a T x T mask.

Targets: token t's loss reads the logits at t and the label x[t+1], which may live on the next rank; labels and
target masks are therefore shifted on the full sample before it is sliced (`local_targets`). A sample-level sum
(DPO's sequence log-prob) is a sum over the group (`sum_over_group`, whose backward also sums: each rank then
backpropagates P x its share, which the trainers' data-parallel weighting divides out, see docs/distributed.md).

The group is process-wide state set once by the strategy (`set_sequence_parallel_group`), as the attention function
is called deep inside the model, where no argument reaches.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from rlhfkit.algorithms.logprobs import entropy_from_logits
from rlhfkit.algorithms.sft_loss import shifted_target_mask, token_logprobs

ATTENTION_NAME = "rlhfkit_ulysses"
_GROUP: list[Any] = [None]  # the sequence-parallel process group of this rank, None without sequence parallelism
# the sample ids [R, T] of the whole (padded) batch of the forward in progress, set by `split_for_rank`
_SEGMENTS: list[Any] = [None]


def set_sequence_parallel_group(group: Any) -> None:
    """Make `group` (a torch.distributed group of --ring_attn_size ranks, or None) this process's group."""
    _GROUP[0] = group


def sequence_parallel_size() -> int:
    group = _GROUP[0]
    return dist.get_world_size(group) if group is not None else 1


def sequence_parallel_rank() -> int:
    group = _GROUP[0]
    return dist.get_rank(group) if group is not None else 0


def _all_to_all(x: torch.Tensor, group: Any) -> torch.Tensor:
    """all_to_all_single into a fresh contiguous tensor (a gradient may arrive with any strides, and empty_like
    would copy them: the collective writes its output as if contiguous)."""
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    dist.all_to_all_single(out, x, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    """all_to_all_single over the first dimension (P equal chunks); its own inverse, so also its backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return _all_to_all(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_to_all(grad, ctx.group), None


class _SumOverGroup(torch.autograd.Function):
    """all_reduce(sum) whose backward is all_reduce(sum) of the gradients: every rank computes the same loss of the
    summed value, and each rank's part receives the sum of the ranks' (equal) gradients."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        out = grad.clone()
        dist.all_reduce(out, group=ctx.group)
        return out, None


def sum_over_group(x: torch.Tensor) -> torch.Tensor:
    """`x` summed over the sequence-parallel group (differentiable); `x` itself without one."""
    group = _GROUP[0]
    if group is None:
        return x
    if not x.requires_grad:
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out
    result: torch.Tensor = _SumOverGroup.apply(x, group)
    return result


def heads_to_sequence(x: torch.Tensor, group: Any) -> torch.Tensor:
    """[R, H, T/P, D] (all heads, this rank's tokens) -> [R, H/P, T, D] (this rank's heads, every token)."""
    p = dist.get_world_size(group)
    r, h, t, d = x.shape
    chunks = x.reshape(r, p, h // p, t, d).transpose(0, 1)  # chunk j: the heads that rank j will own
    received = _AllToAll.apply(chunks.contiguous(), group)  # chunk i: my heads of rank i's tokens
    return received.permute(1, 2, 0, 3, 4).reshape(r, h // p, p * t, d)


def sequence_to_heads(x: torch.Tensor, group: Any) -> torch.Tensor:
    """The inverse of `heads_to_sequence`: [R, H/P, T, D] -> [R, H, T/P, D]."""
    p = dist.get_world_size(group)
    r, h, t, d = x.shape
    chunks = x.reshape(r, h, p, t // p, d).permute(2, 0, 1, 3, 4)  # chunk j: rank j's tokens of my heads
    received = _AllToAll.apply(chunks.contiguous(), group)  # chunk i: rank i's heads of my tokens
    return received.transpose(0, 1).reshape(r, p * h, t // p, d)


def ulysses_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      **kwargs: Any) -> tuple[torch.Tensor, None]:
    """A Transformers attention function (q [R, H, T/P, D], k and v [R, Hkv, T/P, D]) -> [R, T/P, H, D].

    It runs sequence-parallel when handed the whole sample's mask ([R, 1, T, T] with T = P x the local length, as
    `sequence_parallel_logprobs` passes it); any other call (evaluation, generation, no group) is Transformers'
    own sdpa attention, so a model switched to this function once stays right for every other forward."""
    group = _GROUP[0]
    if group is None or attention_mask is None or attention_mask.shape[-1] == query.shape[2]:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    p = dist.get_world_size(group)
    if key.shape[1] % p:  # too few key/value heads to split: give every query head its own copy
        repeat = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
    q, k, v = (heads_to_sequence(t, group) for t in (query, key, value))
    if k.shape[1] != q.shape[1]:  # grouped-query attention: query head h reads key/value head h // repeat
        repeat = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    out = segment_attention(q, k, v, _SEGMENTS[0], dropout, scaling)
    return sequence_to_heads(out, group).transpose(1, 2).contiguous(), None


def sample_runs(sample_ids: torch.Tensor) -> list[tuple[int, int]]:
    """[start, end) of each run of equal ids in one row of sample ids."""
    edges = (torch.nonzero(sample_ids[1:] != sample_ids[:-1]).flatten() + 1).tolist()
    bounds = [0, *edges, int(sample_ids.numel())]
    return list(zip(bounds[:-1], bounds[1:]))


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sample_ids: torch.Tensor, dropout: float,
                      scale: float | None) -> torch.Tensor:
    """Causal attention within each run of equal sample ids ([R, H, T, D] each, sample_ids [R, T]): what
    `block_causal_mask` allows, without building its [R, 1, T, T] mask. Each sample is one causal
    scaled_dot_product_attention call, which never materialises T x T (a boolean mask does: torch's CPU attention
    converts it to a float mask of the query dtype, 5 GiB per rank at 32k fp32 tokens). Two padding runs (-1) apart
    no longer see each other; no target reads a padding token's output, so the loss and gradients are the same."""
    rows = []
    for r in range(q.shape[0]):
        parts = [F.scaled_dot_product_attention(q[r:r + 1, :, a:b], k[r:r + 1, :, a:b], v[r:r + 1, :, a:b],
                                                dropout_p=dropout, is_causal=True, scale=scale)
                 for a, b in sample_runs(sample_ids[r])]
        rows.append(torch.cat(parts, dim=2))
    return torch.cat(rows, dim=0)


def _register() -> None:
    """Make ATTENTION_NAME a Transformers attention implementation, with sdpa's mask builder for the plain calls."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(ATTENTION_NAME, ulysses_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION_NAME, sdpa_mask)


def use_ulysses_attention(model: nn.Module) -> None:
    """Route every attention layer of `model` (a Transformers model, or one wrapped by DeepSpeed or PEFT) through
    `ulysses_attention` (idempotent). Stays on for the model's life: the plain calls are sdpa."""
    _register()
    for sub in model.modules():
        config = getattr(sub, "config", None)
        if config is not None and hasattr(config, "_attn_implementation_internal"):
            config._attn_implementation_internal = ATTENTION_NAME


def check_heads(model: nn.Module, size: int) -> None:
    """--ring_attn_size must divide the model's query heads (a UserError, one line, otherwise)."""
    from rlhfkit.config.sequence_parallel import check_ring_heads

    for sub in model.modules():
        heads = getattr(getattr(sub, "config", None), "num_attention_heads", None)
        if isinstance(heads, int):
            check_ring_heads(size, heads)
            return


# -- one sample over the group: the slice of each rank ------------------------------------------------------------
def _full_layout(batch: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], int]:
    """The whole batch as per-token rows [R, T] before slicing, and its number of samples: input_ids,
    position_ids, sample_ids (who a token may attend to: its own sample; -1 = padding), labels (token t+1),
    targets (bool: token t+1 is a target of the loss) and owner (the sample of token t+1). Shifting here, on the
    whole sample, keeps a target whose label sits on the next rank's slice."""
    ids = batch["input_ids"]
    rows, width = ids.shape
    batch = {"loss_mask": torch.zeros_like(ids), **batch}  # a reward model's batch needs no targets
    if "sample_ids" in batch:  # packed (docs/CONVENTIONS.md): positions restart per sample
        sample_ids, positions = batch["sample_ids"], batch["position_ids"]
        targets = shifted_target_mask(batch["loss_mask"], sample_ids)
        owner = sample_ids[:, 1:].clamp(min=0)
        num_samples = int(sample_ids.max().item()) + 1
    else:  # padded: a sample per row, positions 0.. as Transformers counts them without position_ids
        sample_ids = torch.where(batch["attention_mask"].bool(), 0, -1)
        positions = torch.arange(width, device=ids.device).expand(rows, width)
        targets = shifted_target_mask(batch["loss_mask"])
        owner = torch.arange(rows, device=ids.device)[:, None].expand(rows, width - 1)
        num_samples = rows
    last = ids.new_zeros(rows, 1)
    layout = {"input_ids": ids, "position_ids": positions, "sample_ids": sample_ids,
              "labels": torch.cat([ids[:, 1:], last], dim=1), "targets": torch.cat([targets, last.bool()], dim=1),
              "owner": torch.cat([owner, last], dim=1)}
    return layout, num_samples


def _padded_to(layout: dict[str, torch.Tensor], multiple: int) -> dict[str, torch.Tensor]:
    """The layout with columns appended to a multiple of the group size: padding tokens (sample id -1, no
    target), which attend only to each other."""
    extra = (-layout["input_ids"].shape[1]) % multiple
    if not extra:
        return layout
    fill = {"sample_ids": -1}
    return {k: F.pad(v, (0, extra), value=fill.get(k, 0)) for k, v in layout.items()}


def block_causal_mask(sample_ids: torch.Tensor) -> torch.Tensor:
    """Boolean [R, 1, T, T] (True = may attend): token t sees t' <= t of its own sample; padding (-1) sees padding.
    The boolean form of `rlhfkit.models.policy.packed_attention_mask` (a quarter of its float32 memory)."""
    n = sample_ids.shape[-1]
    causal = torch.ones(n, n, dtype=torch.bool, device=sample_ids.device).tril()
    return (causal & (sample_ids[:, :, None] == sample_ids[:, None, :]))[:, None]


def split_for_rank(batch: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], torch.Tensor, int, int]:
    """This rank's slice of a padded or packed batch: (its columns of `_full_layout`, a [R, 1, T, T] marker that
    tells `ulysses_attention` to attend within the samples of the whole batch, its first column, the number of
    samples). The slices of the group's ranks, in rank order,
    are the whole batch padded to a multiple of P columns."""
    p, rank = sequence_parallel_size(), sequence_parallel_rank()
    layout, num_samples = _full_layout(batch)
    layout = _padded_to(layout, p)
    n = layout["input_ids"].shape[1] // p
    mine = {k: v[:, rank * n:(rank + 1) * n] for k, v in layout.items()}
    _SEGMENTS[0] = layout["sample_ids"]
    rows, width = layout["sample_ids"].shape
    # The mask the model is handed only says "sequence-parallel" by its [R, 1, T, T] shape (`ulysses_attention`
    # attends within `_SEGMENTS`): an expanded view of one element, so no T x T memory.
    marker = torch.ones((), dtype=torch.bool, device=layout["sample_ids"].device).expand(rows, 1, width, width)
    return mine, marker, rank * n, num_samples


def sequence_parallel_logprobs(model: nn.Module, batch: dict[str, torch.Tensor], fp32: bool = False
                               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """This rank's slice of a padded or packed batch through `model`, all ranks of the group together:
    (log p(label) [R, T/P] (0 off target), targets bool [R, T/P], owner sample [R, T/P], number of samples)."""
    mine, mask, _, num_samples = split_for_rank(batch)
    use_ulysses_attention(model)
    logits = model(input_ids=mine["input_ids"], position_ids=mine["position_ids"], attention_mask=mask,
                   use_cache=False).logits
    if fp32:
        logits = logits.float()
    labels = mine["labels"].masked_fill(~mine["targets"], -100)  # token_logprobs: 0 and no gradient off target
    return token_logprobs(logits, labels), mine["targets"], mine["owner"], num_samples


def whole_rows(local: torch.Tensor, first: int, width: int) -> torch.Tensor:
    """Each rank's columns [R, T/P] (starting at column `first`) -> the whole rows [R, width] on every rank of the
    group: a sum over the group of the slices zero-padded to the padded width (differentiable, `sum_over_group`)."""
    padded_width = local.shape[1] * sequence_parallel_size()
    whole = F.pad(local, (first, padded_width - first - local.shape[1]))
    return sum_over_group(whole)[:, :width]


def sequence_parallel_token_values(backbone: nn.Module, head: nn.Module, batch: dict[str, torch.Tensor]
                                   ) -> torch.Tensor:
    """A value head over the whole batch, [R, T] on every rank of the group (differentiable): each rank runs the
    backbone and head on its slice, and `whole_rows` assembles the rows. A reward model reads it at each sample's
    last token, wherever that token's rank is."""
    mine, mask, first, _ = split_for_rank(batch)
    use_ulysses_attention(backbone)
    hidden = backbone(input_ids=mine["input_ids"], position_ids=mine["position_ids"], attention_mask=mask,
                      use_cache=False).last_hidden_state
    return whole_rows(head(hidden).squeeze(-1).float(), first, batch["input_ids"].shape[1])


def sequence_parallel_next_token_stats(model: nn.Module, batch: dict[str, torch.Tensor], temperature: float = 1.0,
                                       entropy: str | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The RL actor's forward over the group: for every position t of the whole batch, on every rank, log p(token
    t+1) under softmax(logits_t / temperature), [R, T] float32 (differentiable), and with `entropy` ("metric":
    without gradient, "loss": with it) that distribution's entropy [R, T]. Each rank's LM head runs on its own
    slice only; only the [R, T] results cross ranks. Positions whose next token belongs to another sample or to
    padding hold values the caller does not read (the rollout's action positions never point there)."""
    mine, mask, first, _ = split_for_rank(batch)
    use_ulysses_attention(model)
    logits = model(input_ids=mine["input_ids"], position_ids=mine["position_ids"], attention_mask=mask,
                   use_cache=False).logits
    if temperature != 1.0:
        logits = logits / temperature
    width = batch["input_ids"].shape[1]
    logp = whole_rows(token_logprobs(logits, mine["labels"]), first, width)
    if entropy is None:
        return logp, None
    if entropy == "loss":
        return logp, whole_rows(entropy_from_logits(logits), first, width)
    with torch.no_grad():
        return logp, whole_rows(entropy_from_logits(logits.detach()), first, width)


def sequence_parallel_sample_logps(model: nn.Module, batch: dict[str, torch.Tensor], fp32: bool = False
                                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of target-token log-probs [n], target counts [n]) of every sample, summed over the group: the same
    numbers on every rank of it, differentiable (`sum_over_group`)."""
    logps, targets, owner, num_samples = sequence_parallel_logprobs(model, batch, fp32)
    mask = targets.to(logps.dtype)
    sums = logps.new_zeros(num_samples).index_add(0, owner.reshape(-1), (logps * mask).reshape(-1))
    counts = logps.new_zeros(num_samples).index_add(0, owner.reshape(-1), mask.reshape(-1))
    return sum_over_group(sums), sum_over_group(counts.detach())
