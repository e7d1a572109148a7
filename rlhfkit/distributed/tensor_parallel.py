"""Tensor parallel training on the FSDP2 backend (`--ds_tensor_parallel_size N --backend fsdp2`).

The ranks form a 2-D device mesh (dp, tp), row-major, so the N ranks of one TP group are consecutive (global rank
r is data-parallel rank r // N). Within a TP group every decoder layer's attention and MLP projections are split
with torch's tensor parallel (Megatron-LM's layout, Shoeybi et al. 2019, arXiv:1909.08053): q/k/v and gate/up
column-wise (each rank computes its own heads and intermediate features from the whole, replicated input), o and
down row-wise (each rank multiplies its slice and the partial outputs are all-reduced). Embeddings, norms and the
LM head stay whole on every TP rank; their gradients are equal across the group because the column-wise layers
all-reduce the gradient of their replicated input. FSDP2 then shards everything over the dp axis.

The TP ranks of a group see the same micro-batches, so the trainers split data and reduce metrics over the dp axis
only (`dp_rank`, `dp_size`, `dp_group`, used by `DeepSpeedStrategy`).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from rlhfkit.config.tensor_parallel import shape_problem
from rlhfkit.errors import UserError

#: a decoder layer's projections and how each is split (Llama, Qwen2/3, Mistral names)
COLUMN_WISE = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
ROW_WISE = ("self_attn.o_proj", "mlp.down_proj")


@functools.cache
def training_mesh(tp: int) -> Any:
    """The (dp, tp) DeviceMesh of all ranks (made once per process: each mesh makes its own process groups)."""
    from torch.distributed.device_mesh import init_device_mesh

    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    world = dist.get_world_size()
    return init_device_mesh(device_type, (world // tp, tp), mesh_dim_names=("dp", "tp"))


def dp_rank(tp: int) -> int:
    """This rank's data-parallel rank: the TP ranks of one group share it."""
    return dist.get_rank() // tp if dist.is_initialized() else 0


def dp_size(tp: int) -> int:
    return dist.get_world_size() // tp if dist.is_initialized() else 1


def dp_group(tp: int) -> Any:
    """The process group of this rank's data-parallel peers (None, the whole world, without TP)."""
    return training_mesh(tp)["dp"].get_group() if tp > 1 else None


def parallelize_decoder(layers: list[nn.Module], tp: int, shape: dict[str, Any]) -> None:
    """Split each decoder layer's projections over the TP axis of `training_mesh(tp)` (in place); `shape` is the
    model's config (a dict)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    if not layers:
        raise UserError("--ds_tensor_parallel_size: the model lists no decoder layers (_no_split_modules)")
    problem = shape_problem(tp, shape.get("text_config", shape))
    if problem:  # a hub model, whose config.json the config layer could not read
        raise UserError(f"--ds_tensor_parallel_size {tp} does not divide {problem}")
    mesh = training_mesh(tp)["tp"]
    for layer in layers:
        names = {name for name, _ in layer.named_modules()}
        missing = [n for n in COLUMN_WISE + ROW_WISE if n not in names]
        if missing:
            raise UserError(f"--ds_tensor_parallel_size: {type(layer).__name__} lacks {', '.join(missing)}; tensor "
                            "parallel knows Llama-style decoder layers (Llama, Qwen2/3, Mistral)")
        plan: dict[str, Any] = {n: ColwiseParallel() for n in COLUMN_WISE}
        plan.update({n: RowwiseParallel() for n in ROW_WISE})
        parallelize_module(layer, mesh, plan)
