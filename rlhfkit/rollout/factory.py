"""One constructor for rollout engines, used by batch inference and both RL runners: an `EngineSpec`
(`rlhfkit.config.specs`) in, an engine out.

- `local_engine`: one engine in this process (the Transformers engine, or vLLM);
- `engine_group`: `spec.num_engines` engine actors in the slots a `ResourcePlan` gives `spec.placement_role`, behind
  one `RolloutEngineGroup`.
Agent episodes run inside the engines with the `episode_runner` the caller hands over (the engine layer does not
import `rlhfkit.agents`, which sits above it).
"""

from __future__ import annotations

from typing import Any

import torch

from rlhfkit.config.specs import EngineSpec
from rlhfkit.rollout.engine import EpisodeRunner
from rlhfkit.rollout.engine_group import RolloutEngineGroup, create_engine_actors
from rlhfkit.rollout.hf_engine import HFRolloutEngine
from rlhfkit.rollout.hf_engine_actor import HFEngineActor
from rlhfkit.rollout.vllm_engine import VLLMEngine, VLLMEngineArgs, check_vllm_args, create_vllm_engines


def check_engines(spec: EngineSpec, use_gpu: bool) -> None:
    """What the machine must offer the engines (vLLM installed; GPUs for tensor parallelism); UserError."""
    if spec.backend == "vllm":
        check_vllm_args(spec.num_engines, spec.tensor_parallel_size, use_gpu)


def local_engine(spec: EngineSpec, *, use_gpu: bool, tokenizer: Any = None, device: torch.device | str | None = None,
                 episode_runner: EpisodeRunner | None = None) -> Any:
    """One engine in this process; the Transformers engine loads onto `device` (default: the CPU)."""
    if spec.backend == "vllm":
        return VLLMEngine(VLLMEngineArgs.from_spec(spec, use_gpu), episode_runner=episode_runner)
    return HFRolloutEngine.from_spec(spec, tokenizer, device=device, episode_runner=episode_runner)


def engine_group(spec: EngineSpec, plan: Any, *, use_gpu: bool, sync_backend: str = "object",
                 env: dict[str, str] | None = None, wait: bool = True,
                 episode_runner: EpisodeRunner | None = None) -> RolloutEngineGroup:
    """The engine actors of the run in `plan.slots[spec.placement_role]` (vLLM engine i seeded with seed + i), behind
    one group; with `wait`, return once every engine is built."""
    slots = plan.slots[spec.placement_role]
    if spec.backend == "vllm":
        actors = create_vllm_engines(plan, slots, VLLMEngineArgs.from_spec(spec, use_gpu), env=env, wait=wait,
                                     episode_runner=episode_runner)
    else:
        actors = create_engine_actors(HFEngineActor, plan, slots, lambda i: spec, env=env, wait=wait,
                                      episode_runner=episode_runner)
    return RolloutEngineGroup(actors, sync_backend=sync_backend)
