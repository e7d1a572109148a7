"""The router load-balancing loss of mixture-of-experts models (`--aux_loss_coef`).

Switch Transformer (Fedus et al. 2021, "Switch Transformers: Scaling to Trillion Parameter Models with Simple and
Efficient Sparsity", eqs. 4-6): aux = E * sum_e f_e * P_e, with f_e the fraction of (top-k) routing assignments
that go to expert e and P_e the mean router probability of e, over the non-padding tokens of every MoE layer. It is
smallest when tokens spread evenly over the experts. Transformers computes it in a MoE model's forward when asked
for router logits (`output.aux_loss`, padding excluded through the 2-D attention mask); a trainer adds
`aux_loss_coef x aux` to its own loss, as OpenRLHF does. The model's own `router_aux_loss_coef` is not used: it
applies only when the model computes the LM loss itself (labels), which rlhfkit's trainers never ask for.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from rlhfkit.errors import UserError

if TYPE_CHECKING:  # Transformers' modeling stack is imported where a model is: a Ray driver imports this module
    from transformers import PretrainedConfig, PreTrainedModel


def is_moe_config(config: PretrainedConfig) -> bool:
    """A model with an expert router whose forward can return the load-balancing loss (Mixtral, Qwen2-MoE,
    OLMoE, ...: Transformers gives all of them `output_router_logits` and `router_aux_loss_coef`)."""
    return hasattr(config, "output_router_logits") and hasattr(config, "router_aux_loss_coef")


def check_aux_loss_coef(coef: float, model_path: str | None, flag: str = "--pretrain") -> None:
    """Fail before any model loads when `--aux_loss_coef` cannot act because the model has no experts (the flag's
    own rules, >= 0 and no packing, are the config's: `rlhfkit.config.common.check_aux_loss_flags`)."""
    if coef <= 0:
        return
    from rlhfkit.models.loading import check_model_path, load_model_config

    config = load_model_config(check_model_path(model_path, flag), flag)
    if not is_moe_config(config):
        raise UserError(f"--aux_loss_coef {coef} applies to mixture-of-experts models only; {flag} {model_path} is "
                        f"a {getattr(config, 'model_type', 'dense')} model without an expert router: drop "
                        "--aux_loss_coef")


def _router_model(model: nn.Module) -> PreTrainedModel | None:
    """The outermost Transformers model with a router inside a DeepSpeed engine / PEFT wrapper (the module whose
    output carries `aux_loss`; its inner base model returns router logits only)."""
    from transformers import PreTrainedModel

    for module in model.modules():
        if isinstance(module, PreTrainedModel) and is_moe_config(module.config):
            return module
    return None


@contextmanager
def router_aux_loss(model: nn.Module, enabled: bool = True) -> Iterator[list[torch.Tensor]]:
    """Collect the load-balancing loss of every forward pass of `model` run inside the block.

    Yields a list that holds one `aux_loss` tensor (with its graph) per forward; it stays empty when `enabled` is
    False or the model has no router. Router logits are switched on through the config for the block only, so the
    forward call sites stay the same for dense and MoE models."""
    losses: list[torch.Tensor] = []
    target = _router_model(model) if enabled else None
    if target is None:
        yield losses
        return

    def keep(_module: nn.Module, _args: Any, output: Any) -> None:
        aux = getattr(output, "aux_loss", None)
        if isinstance(aux, torch.Tensor):
            losses.append(aux)

    previous = target.config.output_router_logits
    target.config.output_router_logits = True
    handle = target.register_forward_hook(keep)
    try:
        yield losses
    finally:
        handle.remove()
        target.config.output_router_logits = previous
