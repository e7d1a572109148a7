"""Logits at chosen positions only, with the last decoder layer run only where they are read.

A causal LM's logits at positions `keep` need every layer at every position except the last one: there, the
positions outside `keep` contribute only their keys and values (later kept queries attend to them). With long
prompts and short answers that is most of the last layer (for a 7-layer model, ~13% of all layer FLOPs), forward
and backward. `trimmed_forward` runs that layer with queries, output projection, residual and MLP at `keep` only,
K/V at every position (into the caller's cache too, exactly as Hugging Face stores them), and falls back to plain
Hugging Face (`logits_to_keep`) for models whose last layer it does not know how to trim.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

# Decoder layers of this shape: input_layernorm -> self_attn (q/k/v/o_proj, rotary from position_embeddings,
# optional per-head q_norm/k_norm) -> residual -> post_attention_layernorm -> mlp -> residual.
TRIMMABLE_LAYERS = frozenset({"LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer"})
_LAYER_PARTS = ("self_attn", "input_layernorm", "post_attention_layernorm", "mlp")
_ATTN_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling", "layer_idx")

# Kept positions as the patched forwards index with them: a slice when they are one contiguous run (`_as_index`)
Positions = torch.Tensor | slice

# A Hugging Face decoder layer or attention module, read by duck typing after `_trimmable` checked its parts
# (nn.Module's __getattr__ types every child as `Tensor | Module`, which no call site here can use).
HFModule = Any


@functools.cache
def keeps_logits(forward: Callable[..., Any]) -> bool:
    """Whether a model class's forward (`type(model).forward`) takes Hugging Face's `logits_to_keep`."""
    return "logits_to_keep" in inspect.signature(forward).parameters


def base_model(model: nn.Module) -> nn.Module:
    """The Transformers model inside a DeepSpeed engine (`.module`) and/or a PEFT wrapper (`get_base_model()`)."""
    inner: HFModule = getattr(model, "module", model)
    return inner.get_base_model() if hasattr(inner, "get_base_model") else inner


def _last_layer(base: nn.Module) -> HFModule | None:
    decoder = getattr(base, "model", None)
    layers = getattr(decoder, "layers", None)
    count = getattr(getattr(base, "config", None), "num_hidden_layers", None)
    if not isinstance(layers, nn.ModuleList) or not count or len(layers) < count:
        return None
    return layers[count - 1]


def _trimmable(base: nn.Module, kv_length: int, hf_kwargs: dict[str, Any]) -> HFModule | None:
    """The last decoder layer when `trimmed_forward` can run it on the kept positions only, else None."""
    config = getattr(base, "config", None)
    layer = _last_layer(base)
    if layer is None or type(layer).__name__ not in TRIMMABLE_LAYERS:
        return None
    attn: HFModule = getattr(layer, "self_attn", None)
    if not all(hasattr(layer, a) for a in _LAYER_PARTS) or not all(hasattr(attn, a) for a in _ATTN_PARTS):
        return None
    if getattr(config, "_attn_implementation", None) not in ("sdpa", "eager"):
        return None
    window = attn.sliding_window if hasattr(attn, "sliding_window") else getattr(config, "sliding_window", None)
    if window is not None and window <= kv_length:  # a sliding window in effect: its mask rows are not causal ones
        return None
    if getattr(layer, "gradient_checkpointing", False) or getattr(base, "is_gradient_checkpointing", False):
        return None  # the recompute in backward would call the restored, untrimmed forward
    if hf_kwargs.get("output_hidden_states") or hf_kwargs.get("output_attentions"):
        return None
    return layer


def _as_index(keep: torch.Tensor) -> Positions:
    """`keep` as a slice when it is one contiguous run held on the host (the suffix from the first target position
    on, as SFT/DPO/KTO ask): x[:, a:b] is a view, where x[:, tensor] copies in forward and accumulates with
    index_put in backward (measurable with two threads). Same values either way; a device tensor stays (reading it
    would wait for the device)."""
    if keep.device.type != "cpu" or keep.numel() == 0:
        return keep
    first, last = int(keep[0]), int(keep[-1])
    return slice(first, last + 1) if last - first + 1 == keep.numel() else keep


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding (Su et al. 2021, RoFormer) in Hugging Face's rotate-half layout."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)


def _mask_rows(mask: torch.Tensor | None, keep: Positions, kv_length: int, query_length: int,
               like: torch.Tensor, eager: bool) -> torch.Tensor:
    """The attention mask's rows at `keep`; for HF's mask-free causal case, the causal rows (key j is seen by the
    query at position p when j <= p + the cache's past length)."""
    if mask is not None:
        return mask[:, :, keep] if mask.shape[-2] == query_length else mask
    past = kv_length - query_length
    if isinstance(keep, slice):
        keep = torch.arange(query_length, device=like.device)[keep]
    allowed = torch.arange(kv_length, device=keep.device)[None, :] <= (keep + past)[:, None]
    if not eager:
        return allowed[None, None]
    rows = torch.zeros(allowed.shape, dtype=like.dtype, device=like.device)
    return rows.masked_fill_(~allowed, torch.finfo(like.dtype).min)[None, None]


def _trimmed_attention_forward(attn: HFModule, keep: Positions, hidden_states: torch.Tensor,
                               position_embeddings: tuple[torch.Tensor, torch.Tensor],
                               attention_mask: torch.Tensor | None = None, past_key_values: Any = None,
                               **kwargs: Any) -> tuple[torch.Tensor, None]:
    """The attention's forward with queries at `keep` only: (output [rows, len(keep), hidden], None). Keys and
    values (and the cache update) cover every position; projections are called in Hugging Face's order."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    rows, length = hidden_states.shape[:2]
    kept = hidden_states[:, keep]
    query = attn.q_proj(kept).view(rows, kept.shape[1], -1, attn.head_dim)
    if hasattr(attn, "q_norm"):  # Qwen3: RMSNorm over each head's vector
        query = attn.q_norm(query)
    key = attn.k_proj(hidden_states).view(rows, length, -1, attn.head_dim)
    if hasattr(attn, "k_norm"):
        key = attn.k_norm(key)
    value = attn.v_proj(hidden_states).view(rows, length, -1, attn.head_dim).transpose(1, 2)
    cos, sin = position_embeddings
    query = _rotate(query.transpose(1, 2), cos[:, keep], sin[:, keep])
    key = _rotate(key.transpose(1, 2), cos, sin)
    if past_key_values is not None:
        key, value = past_key_values.update(key, value, attn.layer_idx)
    implementation = attn.config._attn_implementation
    eager_fn = sys.modules[type(attn).__module__].eager_attention_forward
    attention = ALL_ATTENTION_FUNCTIONS.get_interface(implementation, eager_fn)
    mask = _mask_rows(attention_mask, keep, key.shape[2], length, query, implementation == "eager")
    out, _ = attention(attn, query, key, value, mask, scaling=attn.scaling,
                       dropout=attn.attention_dropout if attn.training else 0.0)
    return attn.o_proj(out.reshape(rows, kept.shape[1], -1)), None


def _trimmed_layer_forward(layer: HFModule, keep: Positions, hidden_states: torch.Tensor,
                           attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                           past_key_values: Any = None, use_cache: bool | None = False,
                           position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
                           **kwargs: Any) -> torch.Tensor:
    """The decoder layer's forward with everything after attention at `keep` only: hidden states
    [rows, len(keep), hidden]. Every submodule is called as a module, in Hugging Face's order, so module hooks
    (ZeRO-3's parameter fetch and its per-rank module-order trace) see the same calls as in the plain forward."""
    attended, _ = layer.self_attn(hidden_states=layer.input_layernorm(hidden_states), attention_mask=attention_mask,
                                  past_key_values=past_key_values, position_embeddings=position_embeddings)
    hidden = hidden_states[:, keep] + attended
    return hidden + layer.mlp(layer.post_attention_layernorm(hidden))


def trimmed_forward(model: nn.Module, keep: torch.Tensor, **hf_kwargs: Any) -> torch.Tensor:
    """Logits [rows, len(keep), vocab] at positions `keep` (1-D, increasing, the same for every row) of the causal
    LM `model` (plain, PEFT-wrapped or in a DeepSpeed engine) called with `hf_kwargs` (input_ids or inputs_embeds,
    attention_mask (2D or 4D), position_ids, past_key_values (a cache the caller owns), use_cache, ...).

    Where the last decoder layer is of a known shape (`TRIMMABLE_LAYERS`, sdpa or eager attention, no sliding
    window in effect, no gradient checkpointing) it runs on `keep` only; a cache still receives every position's
    keys and values. Otherwise Hugging Face's `logits_to_keep=keep`, or the full logits indexed at `keep`."""
    base = base_model(model)
    tokens = hf_kwargs.get("input_ids")
    tokens = tokens if tokens is not None else hf_kwargs["inputs_embeds"]
    index = _as_index(keep)
    keep = keep.to(tokens.device)
    cache = hf_kwargs.get("past_key_values")
    kv_length = tokens.shape[1] + (cache.get_seq_length() if cache is not None else 0)
    if len(keep) == tokens.shape[1]:  # every position (keep is increasing): nothing to trim
        return model(**hf_kwargs).logits
    layer = _trimmable(base, kv_length, hf_kwargs) if keep.numel() else None
    if layer is None:
        if keeps_logits(type(base).forward):
            return model(**hf_kwargs, logits_to_keep=keep).logits
        return model(**hf_kwargs).logits[:, keep]
    patched: list[tuple[nn.Module, Callable[..., Any]]] = [(layer, _trimmed_layer_forward),
                                                            (layer.self_attn, _trimmed_attention_forward)]
    saved = [module.__dict__.get("forward") for module, _ in patched]
    try:
        for module, forward in patched:  # instance attributes: the modules' __call__ (and hooks) stay
            module.forward = functools.partial(forward, module, index if isinstance(index, slice) else keep)
        extra = {"logits_to_keep": len(keep)} if keeps_logits(type(base).forward) else {}
        return model(**hf_kwargs, **extra).logits
    finally:
        for (module, _), original in zip(patched, saved, strict=True):
            if original is not None:
                module.forward = original
            elif "forward" in module.__dict__:
                del module.forward
