"""A tiny role for RayActorGroup tests: reports where it runs and uses its torch.distributed world."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from rlhfkit.distributed.ray_groups import dispatch


class EchoRole:
    """Local role object: each method works on CPU tensors / lists, like the roles of the RL loop."""

    def __init__(self, scale: float = 1.0):
        self.scale = scale
        self.model = torch.nn.Linear(2, 2)

    def where(self) -> dict:
        import ray

        ctx = ray.get_runtime_context()
        return {"rank": dist.get_rank(), "world": dist.get_world_size(), "backend": dist.get_backend(),
                "env_rank": int(os.environ["RANK"]), "master": os.environ["MASTER_ADDR"],
                "threads": torch.get_num_threads(), "resources": ctx.get_assigned_resources(),
                "pg": ctx.get_placement_group_id(), "pid": os.getpid()}

    def all_ranks(self) -> list[int]:
        """A real collective: every rank contributes its rank."""
        gathered = [torch.zeros(1) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, torch.tensor([float(dist.get_rank())]))
        return [int(t.item()) for t in gathered]

    @dispatch("split")
    def double(self, batch: torch.Tensor) -> torch.Tensor:
        return batch * 2 * self.scale

    @dispatch("split")
    def lengths(self, items: list[list[int]]) -> dict:
        return {"lengths": [len(x) for x in items], "rank_sum": float(sum(map(sum, items))),
                "ranks": [dist.get_rank()] * len(items)}


