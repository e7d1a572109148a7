"""The FSDP2 training backend (`--backend fsdp2`): PyTorch's `fully_shard` behind the DeepSpeed engine's interface.

`shard_model` applies `fully_shard` to each decoder layer (the classes a Transformers model lists in
`_no_split_modules`), to the backbone and head where they are called apart (`units_to_shard`), then to the root,
over a 1-D device mesh of all ranks: every rank holds 1/world of each parameter, gradient and AdamW moment (as
ZeRO-3), and a unit's parameters are all-gathered just before its forward and backward. Gradients are
reduce-scattered and averaged over ranks, as DeepSpeed averages them, so the trainers' loss weighting
(`rlhfkit.trainers.offline`) gives the same step at any world size.

- `--bf16`: the sharded parameters stay fp32 (the master copy AdamW updates); `MixedPrecisionPolicy` casts the
  gathered parameters to bf16 for compute and reduces gradients in fp32.
- `--adam_offload`: `CPUOffloadPolicy` keeps the parameter shards, their gradients and so the AdamW state in CPU
  memory; torch's AdamW steps them there (DeepSpeed's CPU Adam does not take DTensors).
- Gradient clipping: the norm of the sharded gradients is a DTensor partial sum; `full_tensor()` all-reduces it
  into the global norm, then every shard is scaled by min(1, max_norm / (norm + 1e-6)) (DeepSpeed's formula).
- Checkpoints go through torch.distributed.checkpoint (DCP): each rank writes its own shards plus metadata, and a
  load reshards them to the loading run's world size.
- Export (`full_state_dict`): `get_model_state_dict(full_state_dict=True, cpu_offload=True)` walks the parameters
  one at a time, all-gathers that one tensor on every rank (`full_tensor()`), and only rank 0 keeps a CPU copy;
  the other ranks drop it at once. So rank 0 ends with the whole model in CPU memory (what `save_pretrained` needs),
  while every rank's accelerator holds at most its shards plus one full tensor.

Arithmetic otherwise is `PlainTorchEngine`'s (accumulation boundary, non-finite skip, LR schedule after the step).
"""

from __future__ import annotations

import os
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from rlhfkit.distributed.plain_torch_engine import PlainTorchEngine
from rlhfkit.errors import UserError

ENGINE_STATE = "engine_state.pt"  # beside the DCP shards: schedule and counters, written by rank 0


def _shares_parameters(part: nn.Module, whole: nn.Module) -> bool:
    """Whether a parameter of `part` is also used outside it (a head tied to the embeddings)."""
    inside = {id(p) for p in part.parameters()}
    outside = {id(p) for name, m in whole.named_children() if m is not part for p in m.parameters()}
    return bool(inside & outside)


def units_to_shard(model: nn.Module) -> list[nn.Module]:
    """The FSDP units below the root, innermost first: the decoder layers (the modules whose class is in a
    Transformers model's `_no_split_modules`), then, unless a weight is tied across them, the backbone and each
    other child of the model (a reward model's value head). The reward and value models call the backbone and the
    head one after the other, not the root's forward, so each must gather its own parameters."""
    unwrap = getattr(model, "get_base_model", None)  # a PEFT wrapper's
    base: Any = unwrap() if unwrap is not None else model
    names = set(getattr(base, "_no_split_modules", None) or ())
    units = [m for m in model.modules() if type(m).__name__ in names]
    backbone = getattr(base, getattr(base, "base_model_prefix", ""), None)
    if isinstance(backbone, nn.Module) and backbone is not base and not _shares_parameters(backbone, base):
        units += [m for m in base.children() if m is not backbone and any(True for _ in m.parameters())]
        units.append(backbone)
    return units


def tied_duplicates(model: nn.Module) -> set[str]:
    """Names of parameters that are another parameter under a second name (a head tied to the embeddings)."""
    first: dict[int, str] = {}
    duplicates = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            duplicates.add(name)
        first.setdefault(id(p), name)
    return duplicates


def shard_model(model: nn.Module, bf16: bool, offload: bool, master_fp32: bool = True, tp: int = 1) -> nn.Module:
    """`fully_shard` each decoder layer, then the root (embeddings, final norm, head), over all ranks; with `tp`
    > 1 the decoder layers are first split over the TP axis of a (dp, tp) mesh and FSDP2 shards over dp only
    (`rlhfkit.distributed.tensor_parallel`).

    A trained model's shards are fp32 (`master_fp32`: the copy AdamW updates; bf16 is a compute dtype). A frozen
    one (reference, reward: `prepare_frozen`) keeps the dtype it was loaded in, so a bf16 model holds bf16 shards."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    from rlhfkit.distributed.tensor_parallel import parallelize_decoder, training_mesh

    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if master_fp32:
        model = model.float()
    if device_type == "cuda" and not offload:
        model = model.to(torch.device("cuda", torch.cuda.current_device()))
    if tp > 1:
        config = getattr(model, "config", None)
        shape = config.to_dict() if config is not None else {}
        parallelize_decoder([m for m in units_to_shard(model) if hasattr(m, "self_attn")], tp, shape)
        mesh = training_mesh(tp)["dp"]
    else:
        mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    kwargs: dict[str, Any] = {
        "mesh": mesh,
        "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 and master_fp32 else None,
                                          reduce_dtype=torch.float32),
        "offload_policy": CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if offload else OffloadPolicy(),
    }
    for unit in units_to_shard(model):
        fully_shard(unit, **kwargs)
    fully_shard(model, **kwargs)
    return model


class FSDP2Engine(PlainTorchEngine):
    """A `PlainTorchEngine` over an FSDP2-sharded module: the same interface, a DTensor-aware gradient norm and
    sharded (DCP) checkpoints."""

    export_dtype = torch.float32  # the dtype of `full_state_dict`'s tensors (bf16 with --bf16)

    def _total_norm(self, grads: list[torch.Tensor]) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        # with tensor parallelism the gradients live on two meshes (dp for whole weights, dp x tp for split
        # ones): each mesh's norm is reduced over its own ranks, then the norms combine
        by_mesh: dict[Any, list[torch.Tensor]] = {}
        for g in grads:
            by_mesh.setdefault(g.device_mesh if isinstance(g, DTensor) else None, []).append(g)
        norms = []
        for group in by_mesh.values():
            norm = torch.nn.utils.get_total_norm(group)
            norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
        return torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros(())

    def _clip(self, params: list[torch.Tensor], norm: torch.Tensor) -> None:
        """Clip each mesh's gradients apart: torch's foreach scaling takes one mesh at a time (with tensor
        parallelism the whole weights are on the dp mesh, the split ones on dp x tp)."""
        from torch.distributed.tensor import DTensor

        by_mesh: dict[Any, list[torch.Tensor]] = {}
        for p in params:
            by_mesh.setdefault(p.device_mesh if isinstance(p, DTensor) else None, []).append(p)
        for group in by_mesh.values():
            torch.nn.utils.clip_grads_with_norm_(group, self.max_norm, norm)

    def zero_optimization_stage(self) -> int:
        return 3  # parameters are sharded: callers that gather weights (export, weight sync) must do so

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """All weights as full CPU tensors on rank 0 (gathered one tensor at a time), None on the other ranks."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = cast(dict[str, torch.Tensor], get_model_state_dict(self.module, options=options))  # tensors only
        if dist.get_rank() != 0:
            return None
        # a tied head comes back as its own copy; drop it so the export holds the tensors DeepSpeed's does. With
        # --bf16 the export is bf16, as DeepSpeed's (the fp32 shards are the optimizer's master copy)
        tied = tied_duplicates(self.module)
        return {k: v.to(self.export_dtype) if v.is_floating_point() else v
                for k, v in state.items() if k not in tied}

    def export_module(self, state: dict[str, torch.Tensor]) -> nn.Module:
        """What rank 0's `save_hf_model` writes with `state` (`full_state_dict`): the sharded module itself, whose
        `save_pretrained` takes the gathered state, or for a LoRA (PEFT) model an unsharded copy holding `state`,
        since merging the adapters into sharded weights would need collectives that only rank 0 runs. The copy is
        a second full model in rank 0's CPU memory, beside `state`."""
        module: Any = self.module
        if not hasattr(module, "peft_config"):
            return module
        from peft import get_peft_model
        from torch.distributed.fsdp import FSDPModule

        base = module.get_base_model()
        plain_class: Any = next(c for c in type(base).__mro__ if not issubclass(c, FSDPModule))  # before sharding
        copy = get_peft_model(plain_class(base.config), module.peft_config["default"])
        missing, unexpected = copy.load_state_dict(state, strict=False)  # a tied head is absent from `state`
        if unexpected or set(missing) - tied_duplicates(copy):
            raise RuntimeError(f"LoRA export: the gathered state does not fit the model ({missing}, {unexpected})")
        return copy.to(self.export_dtype)

    # -- checkpoints -----------------------------------------------------------------------------------------
    def save_checkpoint(self, save_dir: str, tag: str, save_latest: bool = False) -> None:
        """Sharded weights and AdamW state under save_dir/tag (DCP, every rank writes its shards), with the LR
        schedule and step counters from rank 0."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        path = os.path.join(save_dir, str(tag))
        model_state, optim_state = get_state_dict(self.module, self.optimizer)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)
        if dist.get_rank() == 0:
            torch.save({"lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None,
                        "global_steps": self.global_steps, "skipped_steps": self.skipped_steps,
                        "world_size": dist.get_world_size()}, os.path.join(path, ENGINE_STATE))
            if save_latest:
                with open(os.path.join(save_dir, "latest"), "w") as f:
                    f.write(str(tag))
        dist.barrier()

    def load_checkpoint(self, load_dir: str, tag: str) -> tuple[str | None, dict[str, Any]]:
        """Restore what `save_checkpoint` wrote, resharded to this run's world size; (None, {}) when absent."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        path = os.path.join(load_dir, str(tag))
        extra = os.path.join(path, ENGINE_STATE)
        if not os.path.isfile(extra):
            if os.path.isfile(os.path.join(path, "mp_rank_00_model_states.pt")):
                raise UserError(f"checkpoint {path} was written by DeepSpeed and this run uses --backend fsdp2; "
                                "resume it with the backend it was written with, or start from its weights with "
                                "--pretrain")
            return None, {}
        model_state, optim_state = get_state_dict(self.module, self.optimizer)
        state: dict[str, Any] = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(self.module, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        saved = torch.load(extra, map_location="cpu", weights_only=False)
        if self.lr_scheduler is not None and saved["lr_scheduler"] is not None:
            self.lr_scheduler.load_state_dict(saved["lr_scheduler"])
        self.global_steps = int(saved["global_steps"])
        self.skipped_steps = int(saved["skipped_steps"])
        self.micro_steps = self.global_steps * self.accumulation_steps
        return path, {}


def prepare_fsdp2(strategy: Any, model: nn.Module, learning_rate: float, num_update_steps: int) -> FSDP2Engine:
    """Shard `model` (`shard_model`) and wrap it with its AdamW and LR schedule in an `FSDP2Engine`.

    The optimizer (`rlhfkit.distributed.optimizers`) is built on the sharded (DTensor) parameters with
    `adam_offload` off: FSDP2's CPU offload already puts the shards and so the AdamW state in CPU memory, where
    torch's AdamW steps them (DeepSpeed's CPU Adam does not take DTensors)."""
    import dataclasses

    from rlhfkit.distributed import optimizers

    a = strategy.args
    model = shard_model(model, strategy.bf16, a.adam_offload, tp=a.ds_tensor_parallel_size)
    optimizer = optimizers.make_optimizer(dataclasses.replace(a, adam_offload=False), model, learning_rate)
    scheduler = optimizers.make_scheduler(a, optimizer, num_update_steps)
    engine = FSDP2Engine(model, optimizer, scheduler, strategy.accumulation_steps, a.max_norm, a.train_batch_size)
    engine.export_dtype = torch.bfloat16 if strategy.bf16 else torch.float32
    return engine


def prepare_frozen(model: nn.Module) -> nn.Module:
    """A frozen model (reference, reward) sharded over all ranks for its forwards: each rank keeps 1/world of every
    weight and a decoder layer is gathered only while it runs (ZeRO-3 inference's layout). Every forward is then a
    collective, which `rlhfkit.rl.role_forward.per_chunk` accounts for (the same number of forwards per rank)."""
    model.requires_grad_(False)
    model.eval()
    return shard_model(model, bf16=False, offload=False, master_fp32=False)
