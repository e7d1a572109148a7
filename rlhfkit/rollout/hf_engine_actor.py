"""The Transformers rollout engine as a Ray actor (`--vllm_num_engines 0` in a Ray run).

`RolloutEngineGroup` (`vllm_engine.py`) drives it exactly as it drives vLLM engine actors: generate, staged weight
updates (`StagedWeights`), sleep/wake (no-ops here), info.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from rlhfkit.config.base import required
from rlhfkit.config.rl import PPOConfig
from rlhfkit.models.loading import load_tokenizer_for, resolve_attn_implementation
from rlhfkit.rollout.hf_engine import HFRolloutEngine
from rlhfkit.rollout.vllm_engine import StagedWeights, apply_env


class HFEngineActor(StagedWeights):
    """The Transformers rollout engine as a Ray actor (`--vllm_num_engines 0`), with staged weight updates."""

    def __init__(self, cfg: PPOConfig, env: dict[str, str] | None = None):
        apply_env(env or {})
        device = torch.device("cuda") if torch.cuda.is_available() else None
        dtype = torch.bfloat16 if cfg.model.bf16 else torch.float32
        self.engine = HFRolloutEngine.from_pretrained(
            required(cfg.model.pretrain, "pretrain"), load_tokenizer_for(cfg.model), dtype=dtype,
            attn_implementation=resolve_attn_implementation(cfg.model.attn_implementation, cfg.model.flash_attn),
            max_batch_size=max(cfg.rollout.micro_rollout_batch_size, 256), device=device)
        self._staged = []

    def generate(self, prompt_ids: Any, *, seed: int | None = None, seed_offset: int = 0, **sampling: Any) -> Any:
        return self.engine.generate(prompt_ids, seed=None if seed is None else seed + seed_offset, **sampling)

    def generate_episodes(self, requests: Any, agent_path: str, *, seed: int | None = None, seed_offset: int = 0,
                          **kwargs: Any) -> Any:
        return self.engine.generate_episodes(requests, agent_path, seed=None if seed is None else seed + seed_offset,
                                             **kwargs)

    def _apply(self, staged: list[tuple[str, torch.Tensor]]) -> int:
        return self.engine.update_weights(dict(staged))

    def sleep(self) -> None:
        self.engine.sleep()

    def wake(self) -> None:
        self.engine.wake()

    def info(self) -> dict[str, Any]:
        return {"kind": "transformers", "pid": os.getpid(), "asleep": False, "sleep_supported": False}
