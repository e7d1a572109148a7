"""Preemption: SIGTERM (what schedulers and spot instances send before they kill a job) stops training at the
next step boundary, after a checkpoint, instead of losing everything since the last one.

The handler only sets a flag; the training loop asks `requested()` after each optimizer step. With several ranks
(torchrun/deepspeed forward SIGTERM to every worker, but not necessarily at the same step) the ranks agree with a
max all-reduce, so they all save the same step and stop together.
"""

from __future__ import annotations

import signal
import threading
from typing import Any


class PreemptionWatch:
    """Installs a SIGTERM handler for the duration of a `with` block (main thread only; elsewhere it is inert)."""

    def __init__(self, strategy: Any):
        self.strategy = strategy
        self.signalled = False
        self._previous: Any = None
        self._installed = False

    def __enter__(self) -> PreemptionWatch:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._on_signal)
            self._installed = True
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._installed:
            signal.signal(signal.SIGTERM, self._previous)
            self._installed = False

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.signalled = True

    def requested(self) -> bool:
        """Whether any rank was signalled (a collective when there are several ranks: call it on every rank)."""
        if getattr(self.strategy, "world_size", 1) > 1:
            return bool(self.strategy.all_reduce(float(self.signalled), "max"))
        return self.signalled


def preemption_message(step: int, ckpt_path: str) -> str:
    return (f"stopped by SIGTERM after step {step}; its checkpoint is in {ckpt_path}. Run the same command with "
            "--load_checkpoint to continue from it")
