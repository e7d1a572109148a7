"""Adapter-only weight sync (`--lora_sync adapter`): a LoRA policy sends the engines its adapter, not merged weights.

The engines hold the frozen base model (loaded from `--pretrain` when they start, as the actor did) and one adapter
slot that each sync replaces (`rlhfkit.models.lora_slot`). The trainer's side:
- `adapter_state(role)` gathers the adapter's tensors under their wire names (PEFT checkpoint names) with its
  config; under ZeRO-3 each adapter parameter is gathered from its shards (a collective: call it on every rank),
  rank 0 keeps a CPU copy;
- `send_adapter_object_store(role, engines)` (every actor rank, Ray runs): rank 0 puts (config, tensors packed into
  one flat buffer with an index, `lora_slot.pack`) into the Ray object store once and every engine reads that one
  object. The bytes moved per sync are the object's size as
  the object store reports it (the adapter's tensors plus their names, the config and pickling), returned for the
  `sync/bytes` metric.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from rlhfkit.distributed.weight_sync import policy_module
from rlhfkit.models.lora_slot import adapter_config, is_adapter_parameter, pack, payload_bytes, wire_name


def _peft_model(role: Any) -> Any:
    module = policy_module(role)
    inner = getattr(module, "module", module)  # a DeepSpeed engine's model
    if not hasattr(inner, "peft_config"):
        raise RuntimeError("adapter-only sync needs a LoRA policy (--lora_rank > 0)")
    return inner


def iter_adapter(role: Any, keep: bool) -> Iterator[tuple[str, torch.Tensor | None]]:
    """(wire name, CPU tensor) of every adapter parameter, one at a time; None off a `keep` rank (see module doc)."""
    model = _peft_model(role)
    for name, param in model.named_parameters():
        if not is_adapter_parameter(name):
            continue
        if hasattr(param, "ds_id"):  # ZeRO-3: the parameter's shards, gathered for the copy
            import deepspeed

            with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
                yield wire_name(name), (param.data.detach().to("cpu", copy=True) if keep else None)
        else:
            yield wire_name(name), (param.data.detach().to("cpu", copy=True) if keep else None)


def adapter_state(role: Any, keep: bool = True) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(adapter config, {wire name: CPU tensor}) of the role's LoRA policy; empty tensors off a `keep` rank."""
    tensors = {name: t for name, t in iter_adapter(role, keep) if t is not None}
    return adapter_config(_peft_model(role)), tensors


def send_adapter_object_store(role: Any, engines: list[Any]) -> tuple[int, int]:
    """Run on every actor rank: rank 0 puts the adapter into the object store once and every engine loads it
    (`receive_adapter`); returns (bytes of that object, bytes of the adapter's tensors) on rank 0, zeros elsewhere."""
    import ray

    rank = dist.get_rank() if dist.is_initialized() else 0
    config, tensors = adapter_state(role, keep=rank == 0)
    if rank != 0:
        return 0, 0
    ref = ray.put((config, *pack(tensors)))
    ray.get([e.receive_adapter.remote(ref) for e in engines])
    return object_size(ref), payload_bytes(tensors)


def object_size(ref: Any) -> int:
    """The size of an object in the Ray object store, in bytes (what every reader of it transfers)."""
    from ray.experimental import get_object_locations

    return int(get_object_locations([ref])[ref]["object_size"])
