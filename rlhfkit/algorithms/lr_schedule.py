"""Learning-rate schedules: the factor of the peak learning rate at each optimizer step (`--lr_scheduler`).

Every schedule first warms up linearly from 0 over `warmup` steps (`--lr_warmup_ratio` of the run's steps), then:
- `constant`: no warmup and no decay (factor 1 from the first step);
- `constant_with_warmup`: 1;
- `linear`: down to 0 at the last step;
- `cosine`: half a cosine period, 1 to 0 (Loshchilov and Hutter 2017, "SGDR: Stochastic Gradient Descent with Warm
  Restarts", without restarts);
- `cosine_with_min_lr`: the same cosine, rescaled to end at `min_lr_rate` (`--min_lr_ratio`), OpenRLHF's default.

These are Transformers' schedules of the same names (`transformers.get_scheduler`), value for value: checked step
by step against it in tests/algorithms/test_lr_schedule.py. They live here so that a training process does not
import `transformers.optimization`, which imports the Trainer's utilities and with them PEFT (about 230 modules,
10 MB in every actor, critic and trainer process). The factor is a picklable `functools.partial` of `lr_factor`,
as Transformers' is, so a LambdaLR's saved state is the same in both.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

from rlhfkit.config.common import LR_SCHEDULERS as SCHEDULES  # the --lr_scheduler choices


def lr_factor(step: int, *, name: str, warmup: int, total: int, min_lr_rate: float = 0.0) -> float:
    """The factor of the peak learning rate at optimizer step `step` (0-based) of `total`."""
    if name == "constant":
        return 1.0
    if step < warmup:
        return float(step) / float(max(1, warmup))
    if name == "constant_with_warmup":
        return 1.0
    if name == "linear":
        return max(0.0, float(total - step) / float(max(1, total - warmup)))
    progress = float(step - warmup) / float(max(1, total - warmup))
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    if name == "cosine":
        return max(0.0, cosine)
    if name == "cosine_with_min_lr":
        return max(0.0, cosine * (1.0 - min_lr_rate) + min_lr_rate)
    raise ValueError(f"unknown learning-rate schedule {name!r}; one of {', '.join(SCHEDULES)}")


def schedule(name: str, warmup: int, total: int, min_lr_rate: float = 0.0) -> Callable[[int], float]:
    """`lr_factor` of one schedule, for `torch.optim.lr_scheduler.LambdaLR`."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown learning-rate schedule {name!r}; one of {', '.join(SCHEDULES)}")
    return functools.partial(lr_factor, name=name, warmup=warmup, total=total, min_lr_rate=min_lr_rate)
