"""Reward and critic models on a vision-language base (the Qwen2-VL / Qwen2.5-VL family): the model's multimodal
backbone (vision tower + language model, `model`) and a linear head reading one scalar per token.

Transformers has no sequence-classification class for these models, so this module builds one per family: the
family's own pretrained-model base (so weights load, save and initialise as Transformers does them), its
`...VLModel` backbone under `model` and the head under `--value_head_prefix` (default `score`), which is what
`rlhfkit.models.value_model.token_values` reads. A vision-language causal-LM checkpoint loads into it directly
(its `model.*` tensors are the backbone's; `lm_head` is dropped), and a saved reward model or critic loads back
with its head. The backbone gets the forward hook of `rlhfkit.models.vision` (M-RoPE positions from the ids, and
per-sample ones on packed rows), so value forwards of padded and packed batches with images agree.
"""

from __future__ import annotations

import functools
from typing import Any

from torch import nn

from rlhfkit.models.vision import add_multimodal_positions, check_vision_family

# A causal-LM checkpoint's tensor names (Transformers saves Qwen2-VL in its original layout: `visual.*` and
# `model.*` for the language model) -> the backbone's (`model.visual.*`, `model.language_model.*`); a saved value
# model's names are the backbone's already and pass unchanged.
CAUSAL_LM_KEYS = {r"^visual": "model.visual", r"^model\.(?!language_model|visual)": "model.language_model."}


@functools.cache
def vision_value_class(model_type: str) -> Any:
    """The value-model class of a vision-language family: `<Family>PreTrainedModel` with the family's backbone
    under `model` and a linear head (1 output, no bias, as Transformers' sequence classifiers have) named by
    `config.value_head_prefix`."""
    import importlib

    module, prefix = {"qwen2_5_vl": ("qwen2_5_vl", "Qwen2_5_VL")}.get(model_type, ("qwen2_vl", "Qwen2VL"))
    family = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
    base, backbone = getattr(family, f"{prefix}PreTrainedModel"), getattr(family, f"{prefix}Model")
    name = f"{prefix}ForValue"

    def __init__(self: Any, config: Any) -> None:
        base.__init__(self, config)
        self.model = backbone(config)
        head = nn.Linear(config.text_config.hidden_size, 1, bias=False)
        setattr(self, getattr(config, "value_head_prefix", "score"), head)
        self.post_init()

    return type(name, (base,), {"__init__": __init__, "base_model_prefix": "model"})


def load_vision_value_model(loader: Any, config: Any, path: str, flag: str, value_head_prefix: str,
                            **kwargs: Any) -> Any:
    """The value model of the vision-language checkpoint at `path` (its Transformers `config`), loaded with
    `loader(cls, path, flag, config=..., **kwargs)` (rlhfkit's `_from_pretrained`); its backbone's forward
    computes the M-RoPE positions of image rows."""
    check_vision_family(config, path, flag)
    config.value_head_prefix = value_head_prefix
    model = loader(vision_value_class(config.model_type), path, flag, config=config, key_mapping=CAUSAL_LM_KEYS,
                   **kwargs)
    add_multimodal_positions(model.model)
    return model
