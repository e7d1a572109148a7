"""The Transformers rollout engine as a Ray actor (`--vllm_num_engines 0` in a Ray run, `--num_engines N` of batch
inference).

`RolloutEngineGroup` (`engine_group.py`) drives it exactly as it drives vLLM engine actors: generate, staged weight
updates (`StagedWeights`), sleep/wake (no-ops here), info.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from rlhfkit.config.specs import EngineSpec
from rlhfkit.distributed.determinism import enable_full_determinism, flag_from_env
from rlhfkit.distributed.startup_clock import mark
from rlhfkit.rollout.engine import EpisodeRunner
from rlhfkit.rollout.hf_engine import HFRolloutEngine
from rlhfkit.rollout.staged_weights import StagedWeights, apply_env


class HFEngineActor(StagedWeights):
    """The Transformers rollout engine as a Ray actor, built from its `EngineSpec`, with staged weight updates."""

    def __init__(self, spec: EngineSpec, env: dict[str, str] | None = None,
                 episode_runner: EpisodeRunner | None = None):
        mark("started")
        apply_env(env or {})
        if flag_from_env():  # a --full_determinism run: the engine's forwards add in one fixed order too
            enable_full_determinism()
        device = torch.device("cuda") if torch.cuda.is_available() else None
        self.engine = HFRolloutEngine.from_spec(spec, device=device, episode_runner=episode_runner)
        mark("engine_built")
        self._staged = []

    def generate(self, prompt_ids: Any, *, seed: int | None = None, seed_offset: int = 0, **sampling: Any) -> Any:
        return self.engine.generate(prompt_ids, seed=None if seed is None else seed + seed_offset, **sampling)

    def generate_episodes(self, requests: Any, agent_path: str, *, seed: int | None = None, seed_offset: int = 0,
                          **kwargs: Any) -> Any:
        return self.engine.generate_episodes(requests, agent_path, seed=None if seed is None else seed + seed_offset,
                                             **kwargs)

    def _apply(self, staged: list[tuple[str, torch.Tensor]]) -> int:
        return self.engine.update_weights(dict(staged))

    def update_adapter(self, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> int:
        return self.engine.update_adapter(config, tensors)

    def sleep(self) -> None:
        self.engine.sleep()

    def wake(self) -> None:
        self.engine.wake()

    def info(self) -> dict[str, Any]:
        return {"kind": "transformers", "pid": os.getpid(), "asleep": False, "sleep_supported": False}
