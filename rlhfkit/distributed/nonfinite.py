"""Non-finite guard: an optimizer update whose loss or gradients are NaN/inf is skipped on every rank, counted, and
too many in a row stop the run.

The skip itself is DeepSpeed's: its ZeRO 1/2 optimizer computes the global gradient norm (all-reduced over the
data-parallel ranks, so every rank sees the same value), and when that norm is not finite it zeroes the gradients
and leaves weights, optimizer moments and learning-rate schedule untouched (`engine.skipped_steps` counts it).
A non-finite loss always gives a non-finite gradient norm, so one check covers both. ZeRO 0 and 3 in fp32 apply
the update anyway; there the guard sees the non-finite norm after the fact and stops the run at once, since the
weights are already corrupted (the last checkpoint predates it).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

from rlhfkit.errors import UserError


class NonFiniteStop(UserError):
    """Training stopped on non-finite updates: one line, exit code 2, the last checkpoint left as it was."""


class NonFiniteGuard:
    """Watches the engines of one trainer after each optimizer step (call `after_step` once per step)."""

    def __init__(self, limit: int, what: str = "training"):
        self.limit = limit
        self.what = what
        self.total = 0  # skipped updates of this run (the `nonfinite_skipped` metric)
        self.in_a_row = 0
        self._seen: dict[int, int] = {}

    def watch(self, *engines: Any) -> None:
        """Start counting from the engines' current state (after a resume restored their skip counters)."""
        for engine in engines:
            self._seen[id(engine)] = int(getattr(engine, "skipped_steps", 0))

    def after_step(self, step: int, *engines: Any) -> int:
        """Count the updates DeepSpeed skipped for a non-finite gradient norm in this step; raise NonFiniteStop
        after `limit` skipped steps in a row, or at once when an engine applied a non-finite update. Returns the
        run's total of skipped updates."""
        skipped = False
        for engine in engines:
            count = int(getattr(engine, "skipped_steps", 0))
            before = self._seen.setdefault(id(engine), 0)
            self._seen[id(engine)] = count
            if count > before:
                skipped = True
                continue
            norm = engine.get_global_grad_norm() if hasattr(engine, "get_global_grad_norm") else None
            if norm is None:  # ZeRO 0 keeps no norm: a non-finite update shows in the (local, replicated) weights
                norm = 0.0 if weights_finite(engine.parameters()) else math.nan
            if not math.isfinite(float(norm)):
                raise NonFiniteStop(f"{self.what} step {step}: the gradient norm is {float(norm)} and this "
                                    "configuration (ZeRO stage 0 or 3 in fp32) cannot skip the update, so the run "
                                    "stopped; resume from the last checkpoint with --load_checkpoint and a lower "
                                    "learning rate (ZeRO 1/2 skip such updates)")
        if skipped:
            self.total += 1
            self.in_a_row += 1
            if self.in_a_row >= self.limit:
                raise NonFiniteStop(f"{self.what} stopped at step {step}: {self.in_a_row} optimizer steps in a row "
                                    "had a non-finite loss or gradient (each was skipped, so the weights and the "
                                    "checkpoints in --ckpt_path are unchanged since); lower the learning rate or "
                                    "check the data, then resume with --load_checkpoint (--max_nonfinite_steps "
                                    f"{self.limit})")
        else:
            self.in_a_row = 0
        return self.total


def weights_finite(params: Iterable[torch.Tensor]) -> bool:
    """Every entry of the trainable `params` is finite, read with one device sync: a tensor holding a NaN or an inf
    has a non-finite norm (`torch._foreach_norm`, one fused kernel per dtype and device). A check per tensor (an
    isfinite, an all and a host sync each) cost 290 syncs and ~1,500 kernel launches per step on a 0.5B model, which
    left the GPU idle (bench/results/gpu.md, 2026-11-27). A finite tensor whose norm overflows (entries beyond ~1e19)
    also counts as non-finite."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for p in params:
        if p.requires_grad:
            local = p.to_local() if hasattr(p, "to_local") else p  # an FSDP2 shard (DTensor): this rank's part
            groups.setdefault((local.device, local.dtype), []).append(local.detach())
    flags = [torch.isfinite(torch.stack(torch._foreach_norm(group))).all().cpu() for group in groups.values()]
    return bool(torch.stack(flags).all()) if flags else True
