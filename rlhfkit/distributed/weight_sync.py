"""Moving weights and states: actor -> rollout engines after every update, and DeepSpeed sleep between phases.

Weight sync streams the actor's parameters one at a time: under ZeRO-3 each parameter is gathered from its
shards with `deepspeed.zero.GatheredParameters`, under FSDP2 (`--backend fsdp2`) with the DTensor's
`full_tensor()` (all ranks take part, rank 0 keeps a CPU copy), so no actor rank holds more than one gathered
parameter plus the buckets in flight. (The engines stage the whole set on the CPU
before applying it, see below.) Rank 0 sends them by one of two transports:

- object store (what `--vllm_sync_backend nccl` falls back to without GPUs, and the path for LoRA policies):
  buckets of about `bucket_mb` MiB go through `ray.put` to every engine's `receive_weights`; at most two buckets
  are in flight.
- process-group broadcast (`--vllm_sync_backend gloo|nccl`): rank 0 and the engines form a side group with its
  own TCP store (a `ProcessGroupGloo`/`ProcessGroupNCCL` made directly, so it never touches the default group of
  either side: the actor's DeepSpeed world, or the world vLLM initialises inside its process) and every tensor
  is broadcast from rank 0; the engines learn names, dtypes and shapes first (`weight_metas`). On CPU only gloo
  exists; NCCL needs every member on a GPU.

The engine applies what it received in one in-place reload when the stream ends (see `rlhfkit/rollout/vllm_engine.py`).

DeepSpeed sleep (`--deepspeed_enable_sleep`): `offload_states(role)` moves every DeepSpeed engine a role holds to
CPU memory (`engine.offload_states()`: parameters, gradients, optimizer states; ZeRO 1-3) and plain modules with
`.to("cpu")`; `reload_states` brings them back. On a CPU-only machine the states already live in CPU memory: the
same walk over the role runs, counts what it would move, and moves nothing (`SLEEP_STATS` records both).
An FSDP2 engine (`--backend fsdp2`) is a plain module here: its shards move with `.to()` (FSDP2's `_apply`
re-registers them) and its AdamW moments with it; under `--adam_offload` (CPUOffloadPolicy) they are already in CPU
memory and nothing moves.
`--ref_reward_offload` uses the same calls for the reference and reward roles (plain modules below ZeRO-3; a
ZeRO-3 inference engine stays sharded where it is).
"""

from __future__ import annotations

import datetime
import sys
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol, TypeGuard

import torch
import torch.distributed as dist
from torch import nn

from rlhfkit.distributed.launch import dist_timeout_s

#: Per-process counters of the sleep path (tests read them through the role's Ray actors).
SLEEP_STATS = {"offloads": 0, "reloads": 0, "bytes": 0, "moved": 0}
_SIDE_GROUPS: dict[str, SideGroup] = {}


# -- finding what a role holds ------------------------------------------------------------------------------------
class _DeepSpeedEngine(Protocol):
    """The part of DeepSpeed's engine (an nn.Module) that sleep and wake use; DeepSpeed ships no type hints."""

    optimizer: Any

    def zero_optimization_stage(self) -> int: ...
    def offload_states(self) -> None: ...
    def reload_states(self) -> None: ...
    def parameters(self) -> Iterator[nn.Parameter]: ...


# Plain modules that offload_states moved to the CPU and reload_states brings back (weak: a dropped role is freed).
_OFFLOADED: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def _is_deepspeed_engine(obj: Any) -> TypeGuard[_DeepSpeedEngine]:
    # A process that never imported DeepSpeed holds no DeepSpeed engine: asking must not import it (a plain-torch
    # actor would pay the import at its first weight sync)
    deepspeed = sys.modules.get("deepspeed")
    engine_cls = getattr(deepspeed, "DeepSpeedEngine", None)
    return engine_cls is not None and isinstance(obj, engine_cls)


def role_modules(role: Any) -> list[nn.Module]:
    """The models a role object holds (DeepSpeed engines or plain modules), found among its attributes."""
    if isinstance(role, nn.Module):
        return [role]
    found: list[nn.Module] = []
    for value in vars(role).values():
        if isinstance(value, nn.Module) and all(value is not m for m in found):
            found.append(value)
    return found


def policy_module(role: Any) -> nn.Module:
    """The actor's model (a DeepSpeed engine or module) inside an actor role."""
    getter = getattr(role, "policy_module", None)
    if callable(getter):
        return getter()
    for name in ("engine", "model", "actor", "module", "policy"):
        value = getattr(role, name, None)
        if isinstance(value, nn.Module):
            return value
    modules = role_modules(role)
    if len(modules) != 1:
        raise RuntimeError(f"cannot tell which model of {type(role).__name__} is the policy ({len(modules)} found)")
    return modules[0]


def _zero_stage(module: nn.Module | _DeepSpeedEngine) -> int:
    if _is_deepspeed_engine(module):
        return int(module.zero_optimization_stage())
    return 3 if any(hasattr(p, "ds_id") for p in module.parameters()) else 0


def _state_bytes(module: nn.Module) -> int:
    total = sum(p.numel() * p.element_size() for p in module.parameters())
    opt = getattr(module, "optimizer", None)
    state = getattr(getattr(opt, "optimizer", opt), "state", {}) or {}
    for per_param in state.values():
        for t in per_param.values() if isinstance(per_param, dict) else ():
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


def _move_optimizer_state(module: nn.Module, device: torch.device) -> None:
    """Move the state tensors (AdamW's moments; FSDP2's are DTensor shards) of the torch optimizer that a plain or
    FSDP2 engine holds as `optimizer` to `device`; a module without one is left alone."""
    optimizer = getattr(module, "optimizer", None)
    if not isinstance(optimizer, torch.optim.Optimizer):
        return
    for per_param in optimizer.state.values():
        for key, value in per_param.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.device != device:  # not "step"
                per_param[key] = value.to(device)


# -- DeepSpeed sleep ----------------------------------------------------------------------------------------------
def offload_states(role: Any) -> int:
    """Move the role's model/optimizer states to CPU memory; returns the bytes concerned (see module docstring)."""
    SLEEP_STATS["offloads"] += 1
    total = 0
    for module in role_modules(role):
        size = _state_bytes(module)
        total += size
        on_accelerator = any(p.device.type != "cpu" for p in module.parameters())
        if not on_accelerator:
            continue  # CPU-only machine: already where offloading would put it
        if _is_deepspeed_engine(module) and module.optimizer is not None and _zero_stage(module) > 0:
            module.offload_states()
        elif not _is_deepspeed_engine(module) or _zero_stage(module) == 0:
            module.to("cpu")  # parameters only: a ZeRO-0 optimizer keeps its states where they are
            if not _is_deepspeed_engine(module):
                _move_optimizer_state(module, torch.device("cpu"))  # a plain or FSDP2 engine's AdamW moments
            _OFFLOADED.add(module)
        else:
            continue  # a ZeRO-3 inference engine: stays sharded (--ref_reward_offload moves plain modules only)
        SLEEP_STATS["moved"] += size
    SLEEP_STATS["bytes"] += total
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return total


def reload_states(role: Any) -> None:
    """Bring back what `offload_states` moved."""
    SLEEP_STATS["reloads"] += 1
    if not torch.cuda.is_available():
        return
    device = torch.device("cuda", torch.cuda.current_device())
    for module in role_modules(role):
        if module in _OFFLOADED:
            module.to(device)
            if not _is_deepspeed_engine(module):
                _move_optimizer_state(module, device)
            _OFFLOADED.discard(module)
        elif _is_deepspeed_engine(module) and module.optimizer is not None and _zero_stage(module) > 0:
            module.reload_states()


# -- streaming the full weights ---------------------------------------------------------------------------------
def iter_full_parameters(module: nn.Module, keep: bool = True, skip: frozenset[str] = frozenset()
                         ) -> Iterator[tuple[str, torch.Tensor | None]]:
    """(name, full tensor) for every parameter not named in `skip`, one at a time; call on every rank (ZeRO-3
    gathers are collective).

    Names are Transformers names (the DeepSpeed engine's `module.` prefix removed). A rank with `keep` gets a CPU
    copy made while the parameter is gathered; the others get None (they only take part in the gather).
    """
    from torch.distributed.tensor import DTensor

    inner = getattr(module, "module", module)
    zero3 = _zero_stage(module) == 3
    for name, param in inner.named_parameters():
        if name in skip:
            continue
        if zero3 and hasattr(param, "ds_id"):
            import deepspeed

            with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
                yield name, (param.data.detach().to("cpu", copy=True) if keep else None)
        elif isinstance(param, DTensor):  # FSDP2: all-gather this one parameter; the full copy dies with the step
            with torch.no_grad():
                full = _full_tensor(param)
            yield name, (full.to("cpu", copy=True) if keep else None)
            del full
        else:
            yield name, (param.data.detach().to("cpu", copy=True) if keep else None)


def _full_tensor(param: Any) -> torch.Tensor:
    """All-gather one FSDP2 parameter (a DTensor). With CPU offload (`--adam_offload`) its shard lives in CPU memory
    while the mesh may be a GPU one, whose NCCL group gathers device tensors only: that one shard goes to the mesh's
    device for the gather (on a CPU machine mesh and shard agree and nothing moves)."""
    from torch.distributed.tensor import DTensor

    mesh = param.device_mesh
    if param.device.type != mesh.device_type:
        param = DTensor.from_local(param.to_local().to(mesh.device_type), mesh, param.placements, run_check=False,
                                   shape=param.shape, stride=param.stride())
    return param.full_tensor()


def _is_peft(module: nn.Module) -> bool:
    return hasattr(getattr(module, "module", module), "peft_config")


def policy_weights(role: Any, keep: bool) -> Iterator[tuple[str, torch.Tensor | None]]:
    """The policy's weights as the engines load them, one at a time (call on every rank, see above).

    A LoRA policy has no such parameters: the role's `state_dict()` (adapters merged, Transformers names) is
    streamed instead, which holds the whole model on rank 0 for the duration of the sync."""
    module = policy_module(role)
    if _is_peft(module):
        state = role.state_dict() or {}
        yield from ((name, t if keep else None) for name, t in state.items())
        return
    # --freeze_visual_encoder: the vision tower is not sent, the engines keep the same loaded one
    frozen: frozenset[str] = getattr(role, "frozen_names", frozenset())
    yield from iter_full_parameters(module, keep, skip=frozen)


def weight_metas(role: Any) -> list[tuple[str, str, tuple[int, ...]]] | None:
    """(name, dtype name, full shape) of every policy parameter, without gathering (ZeRO-3 keeps `ds_shape`, an
    FSDP2 DTensor's `shape` is the full one);
    None for a LoRA policy, whose merged weights are only known after merging (object-store sync then)."""
    if _is_peft(policy_module(role)):
        return None
    inner = getattr(policy_module(role), "module", policy_module(role))
    frozen: frozenset[str] = getattr(role, "frozen_names", frozenset())  # not synced (see `policy_weights`)
    metas = []
    for name, p in inner.named_parameters():
        if name in frozen:
            continue
        shape = tuple(getattr(p, "ds_shape", p.shape))
        metas.append((name, str(p.dtype).removeprefix("torch."), shape))
    return metas


def send_weights_object_store(role: Any, engines: list[Any], bucket_mb: float = 64.0) -> int:
    """Run on every actor rank: stream the policy's weights to `engines` (Ray actor handles) in buckets; returns the
    bytes of the tensors sent to each engine (0 off rank 0)."""
    import ray

    rank = dist.get_rank() if dist.is_initialized() else 0
    limit = int(bucket_mb * 2**20)
    in_flight: list[list[Any]] = []
    bucket: list[tuple[str, torch.Tensor]] = []
    size = moved = 0

    def flush() -> None:
        nonlocal bucket, size
        if bucket:
            ref = ray.put(bucket)
            in_flight.append([e.receive_weights.remote(ref) for e in engines])
            if len(in_flight) > 2:
                ray.get(in_flight.pop(0))
        bucket, size = [], 0

    for name, tensor in policy_weights(role, keep=rank == 0):
        if tensor is None:
            continue
        bucket.append((name, tensor))
        size += tensor.numel() * tensor.element_size()
        moved += tensor.numel() * tensor.element_size()
        if size >= limit:
            flush()
    if rank == 0:
        flush()
        for refs in in_flight:
            ray.get(refs)
    return moved


# -- process-group broadcast --------------------------------------------------------------------------------------
def make_side_group(master_addr: str, master_port: int, rank: int, world_size: int, backend: str = "gloo",
                    key: str = "weight_sync", timeout_s: float | None = None) -> SideGroup:
    """A process group of its own (own TCP store), independent of the default group of this process. Its
    rendezvous and collectives wait at most `timeout_s`, by default --ddp_timeout (`launch.dist_timeout_s`)."""
    timeout = datetime.timedelta(seconds=dist_timeout_s(timeout_s))
    store = dist.TCPStore(master_addr, master_port, world_size, rank == 0, timeout=timeout)
    prefixed = dist.PrefixStore(key, store)
    group: dist.ProcessGroupNCCL | dist.ProcessGroupGloo
    if backend == "nccl":
        group = dist.ProcessGroupNCCL(prefixed, rank, world_size, dist.ProcessGroupNCCL.Options())
    else:
        group = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    side = SideGroup(group, backend, store)
    _SIDE_GROUPS[key] = side
    return side


@dataclass
class SideGroup:
    """A process group made outside torch.distributed's default world, with the store that keeps it alive."""

    group: Any
    backend: str
    store: Any


def broadcast_tensor(side: SideGroup, tensor: torch.Tensor, src: int = 0) -> None:
    side.group.broadcast(tensor, src).wait()


def join_side_group_as_source(role: Any, master_addr: str, master_port: int, world_size: int,
                              backend: str) -> bool:
    """Run on actor rank 0: become rank 0 of the sync group (other actor ranks do nothing)."""
    if dist.is_initialized() and dist.get_rank() != 0:
        return False
    make_side_group(master_addr, master_port, 0, world_size, backend)
    return True


def send_weights_broadcast(role: Any, key: str = "weight_sync") -> int:
    """Run on every actor rank: gather each parameter (collective) and broadcast it from rank 0 to the engines;
    returns the bytes broadcast (0 off rank 0)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    group = _SIDE_GROUPS.get(key) if rank == 0 else None
    if rank == 0 and group is None:
        raise RuntimeError("the weight-sync group was not set up on actor rank 0")
    moved = 0
    for _, tensor in policy_weights(role, keep=rank == 0):
        if tensor is not None:  # rank 0 only (keep=True), where the group exists
            assert group is not None
            if group.backend == "nccl":
                tensor = tensor.to("cuda")
            broadcast_tensor(group, tensor.contiguous(), src=0)
            moved += tensor.numel() * tensor.element_size()
    return moved
