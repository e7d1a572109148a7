"""Weight syncs: how the actor's weights reach the rollout engines after each actor update (and at start and
resume). The trainer holds one and calls `sync()`; the runners choose it:
- `LocalWeightSync` (train_ppo): the actor's weights handed to the in-process engine;
- `RayWeightSync` (train_ppo_ray): weights stream from the actor group's rank 0 straight to the engine actors
  (`RolloutEngineGroup.sync_from`), not through the driver;
- `rlhfkit.rl.async_driver.LockedWeightSync` (--async_train): a Ray sync under the generator's lock, bumping the
  policy version the generator stamps on new samples.

With `adapter` (a LoRA policy under `--lora_sync adapter`, `rlhfkit.config.rl.lora_sync_mode`) both send only the
LoRA adapter into the engines' adapter slot (`rlhfkit.distributed.adapter_sync`); otherwise the full weights (a
LoRA policy's merged into its base; a vision-language policy under --freeze_visual_encoder: its language model's).
`sync()` returns the sync's metrics: `sync/bytes`, the bytes moved to each engine; for full weights `sync/tensors`,
how many tensors each engine loaded; with an adapter `sync/adapter_bytes`, the adapter's size (its tensors' bytes).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

from rlhfkit.rl.role_protocols import Actor
from rlhfkit.rollout.engine import RolloutEngine


class WeightSync(Protocol):
    def sync(self) -> dict[str, float] | None:
        """Actor -> rollout engine(s); returns the sync's metrics (or None)."""
        ...


class LocalWeightSync:
    """The actor's weights (Transformers names), or its LoRA adapter, loaded into an engine of this process. Nothing
    is copied on the way: the bytes moved are the tensors handed over."""

    def __init__(self, actor: Actor, engine: RolloutEngine, adapter: bool = False):
        self.actor = actor
        self.engine = engine
        self.adapter = adapter

    def sync(self) -> dict[str, float]:
        from rlhfkit.models.lora_slot import payload_bytes

        if self.adapter:
            from rlhfkit.distributed.adapter_sync import adapter_state

            config, tensors = adapter_state(self.actor)
            self.engine.update_adapter(config, tensors)
            size = float(payload_bytes(tensors))
            return {"sync/bytes": size, "sync/adapter_bytes": size}
        state = self.actor.state_dict()
        if state is None:  # only ranks other than 0 have none, and a local actor is rank 0
            raise RuntimeError("the local actor returned no state dict")
        loaded = self.engine.update_weights(state)
        return {"sync/bytes": float(payload_bytes(state)), "sync/tensors": float(loaded)}


class RayWeightSync:
    """The actor group's weights (or LoRA adapter) streamed into a `RolloutEngineGroup`; `after_sync` callbacks
    (tests, benchmarks) run after every sync, `seconds` records each sync's wall time."""

    def __init__(self, actor: Any, engines: Any, adapter: bool = False):
        self.actor = actor
        self.engines = engines
        self.adapter = adapter
        self.after_sync: list[Callable[[], None]] = []
        self.seconds: list[float] = []

    def sync(self) -> dict[str, float]:
        started = time.perf_counter()
        if self.adapter:
            moved, size = self.engines.sync_adapter_from(self.actor)
            metrics = {"sync/bytes": float(moved), "sync/adapter_bytes": float(size)}
        else:
            metrics = {"sync/bytes": float(self.engines.sync_from(self.actor)),
                       "sync/tensors": float(getattr(self.engines, "last_sync_tensors", 0))}
        self.seconds.append(time.perf_counter() - started)
        for callback in self.after_sync:
            callback()
        return metrics
