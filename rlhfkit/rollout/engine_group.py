"""Rollout engines as Ray actors, and the handle a run holds over them.

`create_engine_actors` starts one engine actor per placement slot (a vLLM engine, `vllm_engine.py`, or the
Transformers engine actor, `hf_engine_actor.py`); `RolloutEngineGroup` puts them behind the one-engine
`RolloutEngine` interface: it spreads prompts over the engine actors in contiguous slices, gathers the samples back
in prompt order, and fans weight updates and sleep/wake out to every engine. `rlhfkit.rollout.factory` builds
both from an `EngineSpec`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from rlhfkit.rollout.engine import EpisodeRunner, SampledSequence


def create_engine_actors(engine_cls: type, plan: Any, slots: Sequence[Any], make_args: Any,
                         env: dict[str, str] | None = None, use_gpu_per_slot: bool = True,
                         wait: bool = True, episode_runner: EpisodeRunner | None = None) -> list[Any]:
    """Start one `engine_cls(make_args(i), env, episode_runner)` Ray actor per slot; with `wait`, return once all
    are built."""
    import ray

    from rlhfkit.distributed.ray_groups import ray_get, worker_env

    remote_cls: Any = ray.remote(engine_cls)
    engines = []
    for i, slot in enumerate(slots):
        # The env travels as a constructor argument, not a Ray runtime_env, so Ray reuses prestarted workers.
        engines.append(remote_cls.options(num_cpus=slot.num_cpus,
                                          num_gpus=slot.num_gpus if use_gpu_per_slot else 0.0,
                                          scheduling_strategy=plan.scheduling(slot),
                                          ).remote(make_args(i), worker_env(env, slot), episode_runner))
    if wait:
        ray_get([e.info.remote() for e in engines], "the rollout engine")
    return engines


class RolloutEngineGroup:
    """The rollout-engine handle of a Ray run: engine actors behind the one-engine `RolloutEngine` interface.

    `sync_backend`: "object" streams weights through the Ray object store; "gloo" / "nccl" broadcast them from
    the actor's rank 0 in a side process group (see `rlhfkit/distributed/weight_sync.py`)."""

    def __init__(self, engines: list[Any], sync_backend: str = "object", bucket_mb: float = 64.0):
        self.engines = engines
        self.sync_backend = sync_backend
        self.bucket_mb = bucket_mb
        self._group_ready = False
        self.last_sync_seconds = 0.0
        self.last_sync_tensors = 0
        self.last_generate_seconds = 0.0

    def __len__(self) -> int:
        return len(self.engines)

    def generate(self, prompt_ids: Sequence[Sequence[int]], **sampling: Any) -> list[SampledSequence]:
        """Spread the prompts over the engines in contiguous slices (image prompts with their `images`); samples
        come back in prompt order."""
        from rlhfkit.distributed.ray_groups import ray_get, split_for_ranks

        started = time.perf_counter()
        n = min(len(self.engines), max(len(prompt_ids), 1))
        parts = split_for_ranks(list(prompt_ids), n)
        images = sampling.pop("images", None)
        image_parts = split_for_ranks(list(images), n) if images is not None else [None] * n
        refs, offset = [], 0
        for engine, part, part_images in zip(self.engines, parts, image_parts):
            if part:
                with_images = {"images": part_images} if part_images is not None else {}
                refs.append(engine.generate.remote(part, seed_offset=offset, **sampling, **with_images))
            offset += len(part)
        samples = [sample for result in ray_get(refs, "the rollout engine (generate)") for sample in result]
        self.last_generate_seconds = time.perf_counter() - started
        return samples

    def generate_episodes(self, requests: Sequence[dict[str, Any]], agent_path: str, **kwargs: Any) -> list[dict]:
        """Agent episodes spread over the engines in contiguous slices, each engine running its slice at once."""
        from rlhfkit.distributed.ray_groups import ray_get, split_for_ranks

        started = time.perf_counter()
        parts = split_for_ranks(list(requests), min(len(self.engines), max(len(requests), 1)))
        refs, offset = [], 0
        for engine, part in zip(self.engines, parts):
            if part:
                refs.append(engine.generate_episodes.remote(part, agent_path, seed_offset=1_000_000 * offset,
                                                            **kwargs))
            offset += len(part)
        episodes = [episode for result in ray_get(refs, "the rollout engine (agent episodes)") for episode in result]
        self.last_generate_seconds = time.perf_counter() - started
        return episodes

    def update_weights(self, state_dict: dict[str, torch.Tensor]) -> int:
        """Protocol path: a state dict held by this process, put once into the object store for every engine."""
        import ray

        from rlhfkit.distributed.ray_groups import ray_get

        started = time.perf_counter()
        ref = ray.put(dict(state_dict))
        counts = ray_get([e.update_weights.remote(ref) for e in self.engines], "the rollout engine")
        self.last_sync_seconds = time.perf_counter() - started
        return counts[0]

    def sync_from(self, actor_group: Any) -> int:
        """Actor group -> engines, streamed from the actor's rank 0 without passing through this process; returns the
        bytes of the tensors moved to each engine."""
        from rlhfkit.distributed import weight_sync
        from rlhfkit.distributed.ray_groups import ray_get

        started = time.perf_counter()
        metas = None
        if self.sync_backend in ("gloo", "nccl"):
            metas = actor_group.run_on_ranks(weight_sync.weight_metas)[0]  # None: LoRA, object store below
        if metas is not None:
            if not self._group_ready:
                self._init_sync_group(actor_group)
            receivers = [e.receive_broadcast.remote(metas) for e in self.engines]
            moved = ray_get(actor_group.run_async(weight_sync.send_weights_broadcast), "the rollout engine")[0]
            loaded = ray_get(receivers, "the rollout engine")
        else:
            ray_get([e.begin_weight_update.remote() for e in self.engines], "the rollout engine")
            moved = actor_group.run_on_ranks(weight_sync.send_weights_object_store, self.engines, self.bucket_mb)[0]
            loaded = ray_get([e.finish_weight_update.remote() for e in self.engines], "the rollout engine")
        self.last_sync_seconds = time.perf_counter() - started
        self.last_sync_tensors = int(loaded[0])  # tensors each engine loaded
        return int(moved)

    def update_adapter(self, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> int:
        """Protocol path of adapter-only sync: one object-store object of (config, tensors) for every engine."""
        import ray

        from rlhfkit.distributed.ray_groups import ray_get
        from rlhfkit.models.lora_slot import pack

        ref = ray.put((config, *pack(tensors)))
        return ray_get([e.receive_adapter.remote(ref) for e in self.engines], "the rollout engine")[0]

    def sync_adapter_from(self, actor_group: Any) -> tuple[int, int]:
        """Adapter-only sync: the actor's LoRA adapter -> every engine's adapter slot, one object put by the actor's
        rank 0 (`rlhfkit.distributed.adapter_sync`); returns (bytes of that object, moved to each engine; bytes of
        the adapter's tensors)."""
        from rlhfkit.distributed import adapter_sync

        started = time.perf_counter()
        moved, size = actor_group.run_on_ranks(adapter_sync.send_adapter_object_store, self.engines)[0]
        self.last_sync_seconds = time.perf_counter() - started
        return int(moved), int(size)

    def _init_sync_group(self, actor_group: Any) -> None:
        from rlhfkit.distributed import weight_sync
        from rlhfkit.distributed.ray_groups import ray_get

        addr, port = actor_group.rank0_address()
        world = 1 + len(self.engines)
        receivers = [e.init_sync_group.remote(addr, port, i + 1, world, self.sync_backend)
                     for i, e in enumerate(self.engines)]
        actor_group.run_on_ranks(weight_sync.join_side_group_as_source, addr, port, world, self.sync_backend)
        ray_get(receivers, "the rollout engine")
        self._group_ready = True

    def sleep(self) -> None:
        from rlhfkit.distributed.ray_groups import ray_get

        ray_get([e.sleep.remote() for e in self.engines], "the rollout engine")

    def wake(self) -> None:
        from rlhfkit.distributed.ray_groups import ray_get

        ray_get([e.wake.remote() for e in self.engines], "the rollout engine")

    def info(self) -> list[dict[str, Any]]:
        from rlhfkit.distributed.ray_groups import ray_get

        return ray_get([e.info.remote() for e in self.engines], "the rollout engine")

    def shutdown(self) -> None:
        from rlhfkit.distributed.ray_groups import kill_actors

        kill_actors(self.engines)
        self.engines = []


VLLMEngineGroup = RolloutEngineGroup  # the name users of OpenRLHF look for
