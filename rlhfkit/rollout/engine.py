"""The interface every rollout engine implements (Transformers here, vLLM in `vllm_engine.py`).

An engine turns token-id prompts into sampled responses with the log-probability of every sampled token. The RL
loop calls only these methods and passes only plain Python lists and CPU tensors, so an engine can live in this
process, in a Ray actor, or behind a group that spreads prompts over several engines.

Log-probs convention (shared with the actor's training forward): the log-prob of a sampled token is
`log_softmax(logits / temperature)[token]`, the temperature-scaled distribution *before* top-p / top-k truncation
(vLLM's "processed" log-probs without the truncation). With temperature 1 it is the model's plain log-prob. A
greedy call (temperature 0) reports the temperature-1 log-prob.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

FINISH_STOP = "stop"  # the response ended with an end-of-sequence (or stop) token, which it includes
FINISH_LENGTH = "length"  # max_new_tokens was reached


@dataclass
class SampledSequence:
    """One generated sample: prompt ids, response ids, the sampled tokens' log-probs and why it stopped."""

    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # FINISH_STOP or FINISH_LENGTH
    # Agent episodes (rlhfkit.agents): 1 for tokens the policy sampled, 0 for environment feedback; None: all 1.
    action_mask: list[int] | None = None
    # Async training (rlhfkit.rl.async_generator): the policy version that sampled each response token.
    versions: list[int] | None = None
    # Image prompts / agent episodes with image feedback: the images of the whole context, {"pixel_values",
    # "image_grid_thw"} (None: none, or the caller keeps them).
    images: dict[str, torch.Tensor] | None = None


#: Runs agent episodes on an engine: `runner(generate, tokenizer, agent_path, requests, **kwargs)` -> episode dicts
#: (`rlhfkit.agents.episodes.run_episodes`). The engines are handed one by whoever builds them, so the engine layer
#: never imports the agents that sit above it.
EpisodeRunner = Callable[..., list[dict[str, Any]]]


def run_agent_episodes(runner: EpisodeRunner | None, generate: Callable[..., list[SampledSequence]], tokenizer: Any,
                       agent_path: str, requests: Sequence[dict[str, Any]], **kwargs: Any) -> list[dict[str, Any]]:
    """Run the episodes with the engine's `runner`; an engine built without one cannot run agents."""
    if runner is None:
        raise RuntimeError("this rollout engine was built without an episode runner; pass episode_runner= (e.g. "
                           "rlhfkit.agents.episodes.run_episodes) where it is built to run agent episodes")
    return runner(generate, tokenizer, agent_path, requests, **kwargs)


@runtime_checkable
class RolloutEngine(Protocol):
    """What the RL loop needs from a generation engine."""

    def generate(self, prompt_ids: Sequence[Sequence[int]], *, max_new_tokens: int, temperature: float = 1.0,
                 top_p: float = 1.0, top_k: int = -1, seed: int | None = None,
                 stop_token_ids: Sequence[int] | None = None,
                 min_new_tokens: int = 0) -> list[SampledSequence]:
        """One response per prompt, in prompt order (repeat a prompt for several samples)."""
        ...

    def update_weights(self, state_dict: dict[str, torch.Tensor]) -> int:
        """Replace the policy weights (Transformers parameter names); returns how many tensors were loaded."""
        ...

    def update_adapter(self, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> int:
        """Adapter-only sync: replace the engine's LoRA adapter slot (PEFT `config`, tensors under PEFT checkpoint
        names, `rlhfkit.models.lora_slot`) over its unchanged base model; returns how many tensors were loaded."""
        ...

    def sleep(self) -> None:
        """Release accelerator memory between rollouts (may do nothing)."""
        ...

    def wake(self) -> None:
        """Undo `sleep` before the next `generate`."""
        ...
