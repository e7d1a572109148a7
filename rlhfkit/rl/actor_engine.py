"""The Transformers rollout engine inside the actor's own process, on the actor's own module (issue 26, Build 1:
"the engine and actor of the hybrid engine sharing one copy of the weights where the backend allows").

With `--vllm_num_engines 0 --colocate_all_models` the actor and the Transformers engine share one placement bundle
and take turns: the engine generates while the actor waits, the actor trains while the engine waits. A separate
engine actor then only costs: a second process with its own torch and Transformers (about 360 MB PSS on the tiny
model, more than the weights themselves), a second copy of the weights, and a weight sync after every step. Here
`ActorEngine` is the run's engine handle instead: each generate call runs `HFRolloutEngine` on the actor's rank 0
over the module the actor trains (switched to eval mode, under no_grad, for the call), so there is no second
process, no second copy and nothing to sync: the engine always samples from the current weights.

Which runs share is decided once per run by `rlhfkit.config.shared_engine.run_shares_actor_weights` (`ray_run.
check_ray_config`), the rule the `--dry_run` planner also plans with: one actor rank whose module holds the full
weights in the engine's dtype, no LoRA, no --async_train, no image prompts, and the rest listed there; the other runs
keep the separate engine actor, and `RLHFKIT_SHARED_ENGINE=0` forces it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

from rlhfkit.rollout.engine import EpisodeRunner, SampledSequence


# -- in the actor's process -----------------------------------------------------------------------------------------
def _engine_of(role: Any, spec: Any, episode_runner: EpisodeRunner | None) -> Any:
    """The role's engine over its own module, made at the first call and kept on the role."""
    engine = getattr(role, "_shared_rollout_engine", None)
    if engine is None:
        from rlhfkit.distributed.weight_sync import policy_module
        from rlhfkit.models.loading import load_tokenizer
        from rlhfkit.rollout.hf_engine import HFRolloutEngine

        module = policy_module(role)
        module = getattr(module, "module", module)  # the Transformers model inside a DeepSpeed / plain engine
        tokenizer = load_tokenizer(spec.model, use_fast=spec.use_fast_tokenizer)
        engine = HFRolloutEngine(module, tokenizer, max_batch_size=spec.max_batch_size,
                                 episode_runner=episode_runner, shared=True)
        role._shared_rollout_engine = engine
    return engine


def run_engine_on_role(role: Any, spec: Any, episode_runner: EpisodeRunner | None, method: str,
                       args: tuple, kwargs: dict[str, Any]) -> Any:
    """On the actor's rank: `engine.<method>(*args, **kwargs)` with the module in eval mode (no dropout; the same
    forward a separate engine runs), its training mode restored afterwards."""
    engine = _engine_of(role, spec, episode_runner)
    was_training = engine.model.training
    engine.model.eval()
    try:
        return getattr(engine, method)(*args, **kwargs)
    finally:
        engine.model.train(was_training)


def _info(role: Any) -> dict[str, Any]:
    return {"kind": "transformers", "pid": os.getpid(), "asleep": False, "sleep_supported": False,
            "shared_with_actor": True}


# -- in the driver ----------------------------------------------------------------------------------------------------
class ActorEngine:
    """The engine handle of a run whose Transformers engine lives in the actor (`RolloutEngineGroup`'s interface):
    generation runs on the actor group's rank 0; weight syncs move nothing."""

    def __init__(self, actor_group: Any, spec: Any, episode_runner: EpisodeRunner | None = None):
        self.actor = actor_group
        self.spec = spec
        self.episode_runner = episode_runner
        self.engines: list[Any] = []  # no engine actors: nothing to place, time or kill
        self.sync_backend = "shared"
        self.last_sync_seconds = 0.0
        self.last_sync_tensors = 0
        self.last_generate_seconds = 0.0

    def __len__(self) -> int:
        return 1

    def _run(self, method: str, *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        out = self.actor.run_on_ranks(run_engine_on_role, self.spec, self.episode_runner, method, args, kwargs)[0]
        self.last_generate_seconds = time.perf_counter() - started
        return out

    def generate(self, prompt_ids: Sequence[Sequence[int]], **sampling: Any) -> list[SampledSequence]:
        """Samples in prompt order, seeded as engine 0 of a `RolloutEngineGroup` is (seed + offset 0)."""
        return self._run("generate", [list(p) for p in prompt_ids], **sampling)

    def generate_episodes(self, requests: Sequence[dict[str, Any]], agent_path: str, **kwargs: Any) -> list[dict]:
        return self._run("generate_episodes", list(requests), agent_path, **kwargs)

    def sync_from(self, actor_group: Any) -> int:
        """Nothing to move: the engine reads the actor's parameters themselves."""
        return 0

    def info(self) -> list[dict[str, Any]]:
        return self.actor.run_on_ranks(_info)[:1]

    def sleep(self) -> None:
        """The Transformers engine keeps no KV cache between calls: nothing to release."""

    def wake(self) -> None:
        """See `sleep`."""

    def shutdown(self) -> None:
        """The actor group owns the process; it is killed with the group."""
