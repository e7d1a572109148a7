"""Weight syncs: how the actor's weights reach the rollout engines after each actor update (and at start and
resume). The trainer holds one and calls `sync()`; the runners choose it:
- `LocalWeightSync` (train_ppo): the actor's state dict handed to the in-process engine;
- `RayWeightSync` (train_ppo_ray): weights stream from the actor group's rank 0 straight to the engine actors
  (`RolloutEngineGroup.sync_from`), not through the driver;
- `rlhfkit.rl.async_driver.LockedWeightSync` (--async_train): a Ray sync under the generator's lock, bumping the
  policy version the generator stamps on new samples.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

from rlhfkit.rl.role_protocols import Actor
from rlhfkit.rollout.engine import RolloutEngine


class WeightSync(Protocol):
    def sync(self) -> None:
        """Actor -> rollout engine(s)."""
        ...


class LocalWeightSync:
    """The actor's weights (Transformers names) loaded into an engine of this process."""

    def __init__(self, actor: Actor, engine: RolloutEngine):
        self.actor = actor
        self.engine = engine

    def sync(self) -> None:
        state = self.actor.state_dict()
        if state is None:  # only ranks other than 0 have none, and a local actor is rank 0
            raise RuntimeError("the local actor returned no state dict")
        self.engine.update_weights(state)


class RayWeightSync:
    """The actor group's weights streamed into a `RolloutEngineGroup`; `after_sync` callbacks (tests, benchmarks)
    run after every sync, `seconds` records each sync's wall time."""

    def __init__(self, actor: Any, engines: Any):
        self.actor = actor
        self.engines = engines
        self.after_sync: list[Callable[[], None]] = []
        self.seconds: list[float] = []

    def sync(self) -> None:
        started = time.perf_counter()
        self.engines.sync_from(self.actor)
        self.seconds.append(time.perf_counter() - started)
        for callback in self.after_sync:
            callback()
