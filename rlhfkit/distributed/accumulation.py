"""Who decides where an optimizer step ends: the trainer, not the engine's micro-step counter.

A DeepSpeed engine steps the optimizer every `gradient_accumulation_steps` micro-batches by default. With a token
budget (`--use_dynamic_batch`, `rlhfkit.data.token_budget`) the number of micro-batches per optimizer step varies,
so the trainers mark the last micro-batch of each step themselves, before its forward (DeepSpeed's
`set_gradient_accumulation_boundary`, which ZeRO-2/3 also read to time their gradient reduction).
"""

from __future__ import annotations

from typing import Any


def mark_accumulation_boundary(engine: Any, is_last: bool, token_budget: bool) -> None:
    """Tell `engine` whether the coming micro-batch ends the optimizer step.

    An engine without the setter counts micro-batches itself, which is right only for fixed micro-batches, so with
    a token budget it is an error rather than a silently wrong step."""
    setter = getattr(engine, "set_gradient_accumulation_boundary", None)
    if setter is not None:
        setter(is_last)
    elif token_budget:
        raise TypeError(f"{type(engine).__name__} has no set_gradient_accumulation_boundary, so it cannot end an "
                        "optimizer step after a varying number of micro-batches (--use_dynamic_batch)")
