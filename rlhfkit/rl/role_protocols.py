"""The interface of each role of an RL step, as the RL trainer (`rlhfkit.rl.trainer`) and the rollout source
(`rlhfkit.rl.rollout_source`) use it.

A role handle is a local object (`roles.py`: `ActorRole`, `CriticRole`, `ReferenceRole`, `RewardModelRole`), a Ray
actor group serving the same methods (`rlhfkit.distributed.ray_groups.RayActorGroup`), or for the reward a text
reward source (`rlhfkit.rewards.sources`: a reward function, HTTP reward servers). The rollout engine's interface is
`rlhfkit.rollout.engine.RolloutEngine`. Batches are `Experience`s or their `to_dict()`, on the CPU; action tensors
come back as [B, R] matching the batch's R. How a group spreads each method over its ranks is declared next to the
method in `roles.py` (`@dispatch("split")`).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

from rlhfkit.rl.experience import Experience

Batch = Experience | dict[str, Any]


@runtime_checkable
class Checkpointed(Protocol):
    """A trained role: saved as a Hugging Face model and in checkpoints (the signatures of a DeepSpeed engine, so
    `rlhfkit.run.checkpoint.save_checkpoint` takes the role itself)."""

    def save_hf_model(self, path: str) -> None: ...

    def save_checkpoint(self, save_dir: str, tag: str, save_latest: bool = False) -> None: ...

    def load_checkpoint(self, load_dir: str, tag: str) -> tuple[str | None, Any]: ...


@runtime_checkable
class Actor(Checkpointed, Protocol):
    """The policy being trained."""

    def log_probs(self, batch: Batch) -> torch.Tensor:
        """[B, R] log-probs of the response tokens under the current policy (split over ranks)."""
        ...

    def train(self, batch: Batch, kl_coef: float = 0.0, seed: int = 0,
              entropy_metric: bool = True) -> dict[str, float]:
        """--max_epochs passes of policy updates over the experience; the step's actor metrics."""
        ...

    def state_dict(self) -> dict[str, torch.Tensor] | None:
        """The policy weights under Transformers names for the rollout engines (None off rank 0)."""
        ...


@runtime_checkable
class Critic(Checkpointed, Protocol):
    """The value model of PPO (`--advantage_estimator gae`)."""

    def values(self, batch: Batch) -> torch.Tensor:
        """[B, R] the value of the state before each response token (split over ranks)."""
        ...

    def train(self, batch: Batch, seed: int = 0) -> dict[str, float]:
        """--max_epochs passes of value regression on the returns; the critic metrics."""
        ...


@runtime_checkable
class Reference(Protocol):
    """The frozen initial policy."""

    def log_probs(self, batch: Batch) -> torch.Tensor:
        """[B, R] reference log-probs of the response tokens (split over ranks)."""
        ...


@runtime_checkable
class Reward(Protocol):
    """A reward model, a reward function or reward servers."""

    def score(self, batch: dict[str, Any]) -> dict[str, Any]:
        """{"rewards": [B], "scores": [B], "extra_logs": {...}} for the batch's samples (split over ranks)."""
        ...


@runtime_checkable
class Teacher(Protocol):
    """An on-policy distillation teacher: a local model (`rlhfkit.rl.teacher.TeacherRole`) or an endpoint
    (`HTTPTeacher`)."""

    def score(self, batch: Batch) -> dict[str, torch.Tensor]:
        """{"log_probs": [B, R]} (and with top-k "topk_ids", "topk_log_probs" [B, R, k]) of the samples."""
        ...
