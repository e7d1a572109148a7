"""Weight updates of an engine actor in three calls (begin, receive buckets or a broadcast, finish), shared by the
vLLM engine (`vllm_engine.py`) and the Transformers engine actor (`hf_engine_actor.py`), and the environment an
engine process sets before it imports a model library.

Why staged: the trainer streams (name, tensor) pairs in buckets through the Ray object store, or broadcasts them in
a side process group (`rlhfkit/distributed/weight_sync.py`); the engine keeps them on the CPU and applies the whole
set at once at `finish_weight_update` (vLLM must reload fused layers from every part at once, see `vllm_engine.py`).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import Any

import torch


def apply_env(env: dict[str, str]) -> None:
    """Set an engine process's environment (before vllm or a model library is imported there)."""
    os.environ.update(env)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))


class StagedWeights:
    """Weight updates in three calls (begin, receive buckets or a broadcast, finish) for any engine actor.

    Subclasses implement `_apply(staged)`: load every staged (name, CPU tensor) pair at once."""

    _staged: list[tuple[str, torch.Tensor]]
    _sync_group: Any = None

    def begin_weight_update(self) -> None:
        self._staged = []

    def receive_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Stage one bucket of (name, tensor) pairs (Transformers names); returns how many are staged so far."""
        self._staged.extend((name, t.detach().cpu()) for name, t in named_tensors)
        return len(self._staged)

    def finish_weight_update(self) -> int:
        staged, self._staged = getattr(self, "_staged", []), []
        return self._apply(staged) if staged else 0

    def update_weights(self, state_dict: dict[str, torch.Tensor]) -> int:
        """The RolloutEngine one-call update: every weight of the policy under Transformers names."""
        self.begin_weight_update()
        self.receive_weights(state_dict.items())
        return self.finish_weight_update()

    def _apply(self, staged: list[tuple[str, torch.Tensor]]) -> int:
        raise NotImplementedError

    def update_adapter(self, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> int:
        """Adapter-only sync (`rlhfkit.distributed.adapter_sync`): replace the LoRA adapter slot in one call."""
        raise NotImplementedError

    def receive_adapter(self, payload: tuple[dict[str, Any], dict[str, torch.Tensor], list[Any]]) -> int:
        """`update_adapter` on the (config, flat buffers, index) object put into the Ray object store (the tensors
        packed by `rlhfkit.models.lora_slot.pack`)."""
        from rlhfkit.models.lora_slot import unpack

        config, flat, index = payload
        return self.update_adapter(config, unpack(flat, index))

    # -- process-group broadcast (the actor's rank 0 is the source) -------------------------------------------
    def init_sync_group(self, master_addr: str, master_port: int, rank: int, world_size: int,
                        backend: str = "gloo") -> None:
        """Join the side group {actor rank 0, engines 1..N} that weights are broadcast in."""
        from rlhfkit.distributed.weight_sync import make_side_group

        self._sync_group = make_side_group(master_addr, master_port, rank, world_size, backend)

    def receive_broadcast(self, metas: Sequence[tuple[str, str, tuple[int, ...]]]) -> int:
        """Receive every tensor named in `metas` (name, dtype, shape) from group rank 0, then apply them."""
        from rlhfkit.distributed.weight_sync import broadcast_tensor

        if self._sync_group is None:
            raise RuntimeError("init_sync_group was not called on this engine")
        device = torch.device("cuda") if self._sync_group.backend == "nccl" else torch.device("cpu")
        self.begin_weight_update()
        for name, dtype, shape in metas:
            buffer = torch.empty(tuple(shape), dtype=getattr(torch, dtype), device=device)
            broadcast_tensor(self._sync_group, buffer, src=0)
            self._staged.append((name, buffer.cpu()))
        return self.finish_weight_update()
