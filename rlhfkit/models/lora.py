"""LoRA adapters through PEFT (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models").

PEFT is imported only where an adapter is made or merged: a run without LoRA (every process of a Ray run imports
this module through `rlhfkit.run.setup`) never pays its import (about 12 MB and 0.3-0.9 s per process, with
Transformers' Bloom modeling code it pulls in)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import PreTrainedModel


def apply_lora(model: PreTrainedModel, rank: int, alpha: int, dropout: float,
               target_modules: list[str] | None, *, head: str | None = None) -> PeftModel:
    """Wrap `model` so only LoRA matrices train; every linear layer is adapted unless names are given.

    `head`: a reward/critic model's value head (e.g. "score"), freshly initialised, so it trains in full
    (PEFT `modules_to_save`) and is never given an adapter of its own. A 4-bit base (`--load_in_4bit`) is first
    prepared for k-bit training (PEFT: base frozen, norms and head in fp32 for stable adapter training)."""
    from peft import LoraConfig, get_peft_model

    if getattr(model, "is_loaded_in_4bit", False):
        from peft import prepare_model_for_kbit_training

        # Gradient checkpointing is switched on later by the strategy, with the user's reentrant choice.
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    if head is None:
        config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, bias="none", task_type="CAUSAL_LM",
                            target_modules=target_modules or "all-linear")
    else:
        targets = target_modules or sorted({_target_name(name) for name, m in model.named_modules()
                                            if isinstance(m, nn.Linear) and not name.startswith(head)})
        config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, bias="none", task_type="SEQ_CLS",
                            target_modules=[t for t in targets if t != head], modules_to_save=[head])
    return get_peft_model(model, config)


def _target_name(module_name: str) -> str:
    """How a LoRA target names a linear layer: its last name part (`q_proj` adapts every layer's), or its whole name
    where that part is an index (a vision-language merger's `mlp.0`: a bare "0" would also match whole blocks)."""
    last = module_name.rsplit(".", 1)[-1]
    return module_name if last.isdigit() else last


def merged_for_saving(model: PreTrainedModel | PeftModel) -> PreTrainedModel:
    """A plain Transformers model with the LoRA weights merged in (loads without PEFT)."""
    peft = sys.modules.get("peft")  # not imported: `model` cannot be a PEFT model
    if peft is not None and isinstance(model, peft.PeftModel):
        return model.merge_and_unload()
    return model  # type: ignore[return-value]  # a PeftModel was merged above


def merge_adapter(base_path: str, lora_path: str, *, is_rm: bool = False, value_head_prefix: str = "score",
                  dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """The base model at `base_path` with the LoRA adapter at `lora_path` merged in (`lora_combiner`).

    A reward-model adapter (`is_rm`, PEFT task SEQ_CLS) carries its value head in full (`modules_to_save`), which
    replaces the base model's head; a base without a head and an adapter without one is refused."""
    import json
    from pathlib import Path

    from peft import PeftModel

    from rlhfkit.errors import UserError
    from rlhfkit.models.loading import check_model_path, load_causal_lm
    from rlhfkit.models.value_model import _head_was_loaded, load_value_model

    base_path = check_model_path(base_path, "--model_path")
    config_file = Path(lora_path).expanduser() / "adapter_config.json"
    if not config_file.is_file():
        raise UserError(f"--lora_path {lora_path}: no adapter_config.json; give the directory a PEFT adapter was "
                        "saved to (trainers run with --lora_rank write <save_path>/lora_adapter)")
    adapter = json.loads(config_file.read_text())
    rm_adapter = adapter.get("task_type") == "SEQ_CLS"
    if rm_adapter != is_rm:
        hint = "drop --is_rm" if is_rm else "pass --is_rm"
        raise UserError(f"--lora_path {lora_path}: the adapter is for a "
                        f"{'reward model' if rm_adapter else 'causal LM'} (task_type {adapter.get('task_type')}); "
                        f"{hint}")
    if is_rm:
        if value_head_prefix not in (adapter.get("modules_to_save") or []) and \
                not _head_was_loaded(base_path, value_head_prefix):
            raise UserError(f"--lora_path {lora_path}: neither the adapter nor --model_path holds the value head "
                            f"'{value_head_prefix}' (--value_head_prefix); the merged reward model would score "
                            "with a random head")
        base = load_value_model(base_path, value_head_prefix=value_head_prefix, dtype=dtype, flag="--model_path",
                                require_head=False)  # the head may come with the adapter (checked above)
    else:
        base = load_causal_lm(base_path, dtype=dtype, flag="--model_path")
    try:
        model = PeftModel.from_pretrained(base, str(Path(lora_path).expanduser()))
    except (RuntimeError, ValueError, KeyError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UserError(f"--lora_path {lora_path}: does not fit --model_path {base_path}: {first}") from None
    return model.merge_and_unload()
