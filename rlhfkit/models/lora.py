"""LoRA adapters through PEFT (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models")."""

from __future__ import annotations

from peft import LoraConfig, PeftModel, get_peft_model
from torch import nn
from transformers import PreTrainedModel


def apply_lora(model: PreTrainedModel, rank: int, alpha: int, dropout: float,
               target_modules: list[str] | None, *, head: str | None = None) -> PreTrainedModel:
    """Wrap `model` so only LoRA matrices train; every linear layer is adapted unless names are given.

    `head`: a reward/critic model's value head (e.g. "score"), freshly initialised, so it trains in full
    (PEFT `modules_to_save`) and is never given an adapter of its own. A 4-bit base (`--load_in_4bit`) is first
    prepared for k-bit training (PEFT: base frozen, norms and head in fp32 for stable adapter training)."""
    if getattr(model, "is_loaded_in_4bit", False):
        from peft import prepare_model_for_kbit_training

        # Gradient checkpointing is switched on later by the strategy, with the user's reentrant choice.
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    if head is None:
        config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, bias="none", task_type="CAUSAL_LM",
                            target_modules=target_modules or "all-linear")
    else:
        targets = target_modules or sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                                            if isinstance(m, nn.Linear) and not name.startswith(head)})
        config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, bias="none", task_type="SEQ_CLS",
                            target_modules=[t for t in targets if t != head], modules_to_save=[head])
    return get_peft_model(model, config)


def merged_for_saving(model: PreTrainedModel) -> PreTrainedModel:
    """A plain Transformers model with the LoRA weights merged in (loads without PEFT)."""
    if isinstance(model, PeftModel):
        return model.merge_and_unload()
    return model
