"""Process-group bootstrap that works under `deepspeed --module`, `torchrun -m` and plain `python -m`."""

from __future__ import annotations

import os
import socket

import torch


def default_ds_accelerator() -> None:
    """Without CUDA, tell DeepSpeed it runs on CPU (it otherwise warns on import that it fell back to CPU)."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def world_size_from_env() -> int:
    """World size as the launcher set it (1 for plain python)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank_from_env() -> int:
    return int(os.environ.get("RANK", "0"))


def ensure_single_process_env() -> None:
    """Plain `python -m` has no launcher: describe a world of one on loopback."""
    if "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
        return
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))


def default_backend() -> str:
    """NCCL with GPUs, gloo on CPU."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_distributed() -> None:
    """Initialise torch.distributed through DeepSpeed (idempotent)."""
    import deepspeed
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return
    ensure_single_process_env()
    backend = default_backend()
    if backend == "gloo":
        # The shared-memory comm op JIT-compiles for minutes on first use; gloo needs none of it.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    else:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False)
