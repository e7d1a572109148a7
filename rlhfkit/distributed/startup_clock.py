"""Where a Ray run's start-up goes, phase by phase (issue 26: roles and engines up in seconds, not half a minute).

Two halves, joined by the driver:
- in every Ray worker (role ranks, engine actors) `mark(name)` records the wall-clock time a start-up milestone was
  reached in that process (the constructor ran: the process is up and its modules imported; the model is loaded;
  the engine is built); any actor's marks are read with `actor_marks` (through `__ray_call__`, so no actor class
  needs a method for it);
- in the driver a `StartupClock` times its own phases (checks and inputs, `ray.init`, placement groups, building
  the roles and engines, the first weight sync) and turns each actor's marks into the seconds between consecutive
  milestones, counted from the moment the driver asked Ray for that actor.

Everything lands in the run's metrics at step 0 as `startup/<phase>_s` (`startup/actor_model_loaded_s`: the actor
rank 0's seconds from its previous milestone to its model being loaded) and in one printed line.
Wall-clock times (`time.time`) because marks cross processes; on one node they share a clock.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

_MARKS: dict[str, float] = {}


def mark(name: str) -> None:
    """Record the first time this process reached start-up milestone `name`."""
    _MARKS.setdefault(name, time.time())


def marks(_instance: Any = None) -> dict[str, float]:
    """This process's milestones in the order reached (`_instance`: the actor object, when run by `__ray_call__`)."""
    return dict(sorted(_MARKS.items(), key=lambda kv: kv[1]))


def actor_marks(actors: Sequence[Any]) -> list[dict[str, float]]:
    """Each actor's milestones (any Ray actor class)."""
    import ray

    return ray.get([a.__ray_call__.remote(marks) for a in actors])


def intervals(launched: float, milestones: dict[str, float], prefix: str) -> dict[str, float]:
    """`{<prefix>_<milestone>_s: seconds since the previous milestone (the first: since launch)}`."""
    out, last = {}, launched
    for name, at in milestones.items():
        out[f"{prefix}_{name}_s"] = max(0.0, at - last)
        last = at
    return out


class StartupClock:
    """The driver's start-up phases: `lap(phase)` closes the phase that ran since the previous lap; `launched(who)`
    notes when the driver asked Ray for a group of actors, whose marks `add_actor_marks` then turns into phases."""

    def __init__(self) -> None:
        self.started = self.last = time.time()
        self.phases: dict[str, float] = {}
        self.launches: dict[str, float] = {}

    def lap(self, phase: str) -> None:
        now = time.time()
        self.phases[f"{phase}_s"] = now - self.last
        self.last = now

    def launched(self, who: str) -> None:
        self.launches[who] = time.time()

    def add_actor_marks(self, who: str, milestones: dict[str, float]) -> None:
        self.phases.update(intervals(self.launches.get(who, self.started), milestones, who))

    def metrics(self) -> dict[str, float]:
        """`{<phase>_s: seconds}`, logged under startup/."""
        return {**self.phases, "total_s": self.last - self.started}

    def line(self) -> str:
        return "start-up (s): " + ", ".join(f"{k[:-2]} {v:.1f}" for k, v in self.metrics().items())
