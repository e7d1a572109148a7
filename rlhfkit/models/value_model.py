"""Reward and critic models: a causal-LM backbone plus a linear head that reads one scalar per token.

The model is a Transformers `AutoModelForSequenceClassification` with `num_labels=1` (its head is called
`score` for Llama, Qwen2, Mistral, ...), so a saved reward model loads back with plain `from_pretrained` too.
We do not use its pooled output: `token_values` runs the backbone and the head on every position, which the
critic needs, and `sequence_rewards` reads the value at the last real token of each sample (padded or packed).
A vision-language base (Qwen2-VL family) gets the value model of `rlhfkit.models.vision_value`: the same `score`
head on its multimodal backbone, whose forward takes the batch's `pixel_values` / `image_grid_thw`.
Reward statistics for `--normalize_reward` are stored in the config as `reward_mean` / `reward_std`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from rlhfkit.errors import UserError
from rlhfkit.models.loading import _from_pretrained, with_cpu_gemm
from rlhfkit.models.policy import attn_implementation_of, model_dtype, model_inputs
from rlhfkit.models.sequence_parallel import sequence_parallel_size, sequence_parallel_token_values
from rlhfkit.models.vision import is_vision_config
from rlhfkit.models.vision_value import load_vision_value_model

if TYPE_CHECKING:  # the Auto classes are imported where a model loads: a Ray driver imports this module, loads none
    from transformers import PreTrainedModel


def load_value_model(path: str, *, value_head_prefix: str = "score", attn_implementation: str = "sdpa",
                     dtype: torch.dtype = torch.float32, flag: str = "--reward_pretrain",
                     require_head: bool = True, allow_hint: str = "") -> PreTrainedModel:
    """Load a reward/critic model. With `require_head` (a reward model, a critic named on purpose) a checkpoint
    without trained head weights is a UserError naming the missing head (`allow_hint`: how to allow it);
    otherwise (train_rm, the default critic from --pretrain) a plain causal LM gets a freshly initialised head."""
    if require_head:
        check_value_head(path, value_head_prefix, flag, allow_hint)
    from transformers import AutoConfig, AutoModelForSequenceClassification

    config = _from_pretrained(AutoConfig, path, flag)
    if is_vision_config(config):  # a vision-language base: its backbone with a value head (images in the forward)
        model = load_vision_value_model(_from_pretrained, config, path, flag, value_head_prefix, dtype=dtype,
                                        attn_implementation=attn_implementation)
    else:
        config.num_labels = 1
        if config.pad_token_id is None:
            config.pad_token_id = getattr(config, "eos_token_id", None)
        model = _from_pretrained(AutoModelForSequenceClassification, path, flag, config=config, dtype=dtype,
                                 attn_implementation=attn_implementation)
    head = getattr(model, value_head_prefix, None)
    if not isinstance(head, nn.Linear):
        raise UserError(f"{flag} {path}: the model has no linear head named {value_head_prefix!r} "
                        "(--value_head_prefix)")
    if not _head_was_loaded(path, value_head_prefix):
        hidden = head.in_features
        nn.init.normal_(head.weight, std=1.0 / (hidden + 1) ** 0.5)
    model.config.value_head_prefix = value_head_prefix
    return with_cpu_gemm(model)


def check_value_head(path: str, value_head_prefix: str, flag: str, allow_hint: str = "") -> None:
    """UserError when the local checkpoint in `path` has no trained value head (a plain language model given where
    a reward model belongs would otherwise score with a random head). Hub names are not checked here."""
    import os

    if not os.path.isdir(path) or _head_was_loaded(path, value_head_prefix):
        return
    raise UserError(f"{flag} {path} is not a reward model: {value_head_prefix}.weight is not in the checkpoint "
                    f"(no trained value head named {value_head_prefix!r}, --value_head_prefix). Pass a model "
                    f"trained by train_rm{allow_hint}")


def _head_was_loaded(path: str, prefix: str) -> bool:
    """True when the checkpoint in `path` carries weights for the head (a trained RM or critic)."""
    import json
    import os

    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            return any(k.startswith(prefix + ".") for k in json.load(f)["weight_map"])
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(single):
        from safetensors import safe_open

        with safe_open(single, "pt") as f:
            return any(k.startswith(prefix + ".") for k in f.keys())
    for name in ("pytorch_model.bin.index.json", "pytorch_model.bin"):
        file = os.path.join(path, name)
        if os.path.isfile(file) and name.endswith(".json"):
            with open(file) as f:
                return any(k.startswith(prefix + ".") for k in json.load(f)["weight_map"])
        if os.path.isfile(file):
            keys = torch.load(file, map_location="meta", weights_only=True, mmap=True).keys()
            return any(k.startswith(prefix + ".") for k in keys)
    return False


def _unwrap(model: nn.Module) -> PreTrainedModel:
    """The Transformers model inside a DeepSpeed engine and/or a PEFT wrapper (LoRA layers stay in place)."""
    from peft import PeftModel

    inner = getattr(model, "module", model)
    base = inner.get_base_model() if isinstance(inner, PeftModel) else inner
    return cast("PreTrainedModel", base)  # what load_value_model builds: a Transformers sequence classifier


def token_values(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """One scalar per position, [rows, T], from the head applied to the last hidden states."""
    inner = _unwrap(model)
    prefix = getattr(inner.config, "value_head_prefix", "score")
    backbone = getattr(inner, inner.base_model_prefix)
    head = getattr(inner, prefix)
    if sequence_parallel_size() > 1:  # each rank runs its slice of the tokens; the rows come back whole
        return sequence_parallel_token_values(backbone, head, batch)
    inputs = model_inputs(batch, attn_implementation_of(inner), model_dtype(inner))
    hidden = backbone(**inputs, use_cache=False).last_hidden_state
    return head(hidden).squeeze(-1).float()


def last_token_index(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, column) of every sample's last real token, for padded (right padding) or packed batches."""
    if "sample_ids" in batch:
        ids = batch["sample_ids"][0]
        positions = torch.arange(ids.shape[0], device=ids.device)
        real = ids >= 0
        last = torch.zeros(int(ids.max()) + 1, dtype=torch.long, device=ids.device)
        last = last.scatter_reduce(0, ids[real], positions[real], reduce="amax")
        return torch.zeros_like(last), last
    lengths = batch["attention_mask"].long().sum(dim=1)
    rows = torch.arange(lengths.shape[0], device=lengths.device)
    return rows, lengths - 1


def sequence_rewards(model: nn.Module, batch: dict[str, torch.Tensor], normalize: bool = False) -> torch.Tensor:
    """The reward of each sample: the head's value at its last real token, optionally normalised."""
    values = token_values(model, batch)
    rows, cols = last_token_index(batch)
    rewards = values[rows, cols]
    if normalize:
        config = _unwrap(model).config
        mean, std = getattr(config, "reward_mean", 0.0), getattr(config, "reward_std", 1.0)
        rewards = (rewards - mean) / max(std, 1e-8)
    return rewards
