"""LoRA adapters through PEFT (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models")."""

from __future__ import annotations

from peft import LoraConfig, PeftModel, get_peft_model
from transformers import PreTrainedModel


def apply_lora(model: PreTrainedModel, rank: int, alpha: int, dropout: float,
               target_modules: list[str] | None) -> PreTrainedModel:
    """Wrap `model` so only LoRA matrices train; every linear layer is adapted unless names are given."""
    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, bias="none", task_type="CAUSAL_LM",
                        target_modules=target_modules or "all-linear")
    return get_peft_model(model, config)


def merged_for_saving(model: PreTrainedModel) -> PreTrainedModel:
    """A plain Transformers model with the LoRA weights merged in (loads without PEFT)."""
    if isinstance(model, PeftModel):
        return model.merge_and_unload()
    return model
