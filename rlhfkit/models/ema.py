"""An exponential moving average of a model's trainable weights (`--enable_ema`).

After every optimizer step, ema = beta * ema + (1 - beta) * weights, in float32 on the CPU (so it costs host
memory, not device memory). Averaging the iterates smooths the noise of the last updates (Polyak & Juditsky 1992;
the "EMA model" exported by OpenRLHF's --enable_ema). Only parameters that train are averaged: frozen ones (a LoRA
base model) are their own average.

Sharded training keeps the average sharded: under DeepSpeed ZeRO-3 each rank averages its own partition of every
parameter (`param.ds_tensor`), under FSDP2 its local shard (`DTensor.to_local()`), so no rank ever holds the full
average; `swapped_in` swaps the shards, and the export that gathers the weights then gathers the average. The EMA
checkpoint is per rank (the actor saves `actor_ema_rank{r}.pt`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn


def local_part(p: torch.Tensor) -> torch.Tensor:
    """The part of a parameter this rank holds: ZeRO-3's partition (`ds_tensor`), an FSDP2 DTensor's local shard,
    or the whole parameter."""
    part = getattr(p, "ds_tensor", None)
    if part is not None:
        return part
    to_local = getattr(p, "to_local", None)
    return to_local() if callable(to_local) else p


class ParameterEMA:
    def __init__(self, module: nn.Module, beta: float):
        if not 0 < beta < 1:
            raise ValueError(f"EMA beta must be in (0, 1) (got {beta})")
        self.beta = beta
        self.shadow: dict[str, torch.Tensor] = {
            name: local_part(p).detach().float().cpu().clone() for name, p in module.named_parameters()
            if p.requires_grad}
        self.updates = 0

    @torch.no_grad()
    def update(self, module: nn.Module) -> None:
        """Fold the module's current weights into the average (call once per optimizer step)."""
        for name, p in module.named_parameters():
            if name in self.shadow:
                self.shadow[name].mul_(self.beta).add_(local_part(p).detach().float().cpu(), alpha=1.0 - self.beta)
        self.updates += 1

    @contextmanager
    @torch.no_grad()
    def swapped_in(self, module: nn.Module) -> Iterator[None]:
        """The module holds the averaged weights inside the block and its own weights again after it."""
        saved = {}
        parts = {name: local_part(p) for name, p in module.named_parameters()}
        for name, value in self.shadow.items():
            saved[name] = parts[name].detach().clone()
            parts[name].copy_(value.to(parts[name].dtype))
        try:
            yield
        finally:
            for name, value in saved.items():
                parts[name].copy_(value)

    def state_dict(self) -> dict:
        return {"beta": self.beta, "updates": self.updates, "shadow": self.shadow}

    def load_state_dict(self, state: dict) -> None:
        missing = set(self.shadow) ^ set(state["shadow"])
        if missing:
            raise ValueError(f"EMA state does not match the model's trainable parameters: {sorted(missing)[:3]}")
        self.shadow = {k: v.float().cpu().clone() for k, v in state["shadow"].items()}
        self.updates = int(state["updates"])
