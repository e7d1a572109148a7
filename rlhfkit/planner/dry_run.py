"""`--dry_run`: the memory plan of a validated config against the devices it will run on, printed instead of
training (rlhfkit/planner/plan.py builds it, rlhfkit/planner/advice.py adds the advice), and the step-time estimate
(rlhfkit/planner/step_time.py)."""

from __future__ import annotations

import os

from rlhfkit.config.common import DryRunArgs
from rlhfkit.config.kinds import TrainConfig
from rlhfkit.planner import step_time
from rlhfkit.planner.advice import plan_with_advice, render
from rlhfkit.planner.memory import GIB
from rlhfkit.planner.plan import Devices


def _devices(plan_args: DryRunArgs) -> tuple[Devices, int]:
    """What --dry_run plans against: --dry_run_gpu_memory_gb GPUs, else the local GPUs, else the host's memory
    (MemAvailable of /proc/meminfo). Returns (Devices, data-parallel world size of the launcher-run trainers)."""
    world = plan_args.dry_run_num_gpus or int(os.environ.get("WORLD_SIZE", "1"))
    if plan_args.dry_run_gpu_memory_gb is not None:
        return Devices("gpu", plan_args.dry_run_gpu_memory_gb * GIB, world, "--dry_run_gpu_memory_gb"), world
    import torch

    if torch.cuda.is_available():
        memory = torch.cuda.get_device_properties(0).total_memory
        return Devices("gpu", float(memory), torch.cuda.device_count(), "local GPU 0"), world
    available = None
    with open("/proc/meminfo", encoding="ascii") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    if available is None:
        import psutil

        available = psutil.virtual_memory().available
    return Devices("cpu", float(available), 1, "MemAvailable of this machine, no GPU"), world


def _check_rl_heads(cfg: TrainConfig) -> None:
    """The RL commands' --ring_attn_size must split the policy's heads (the preference trainers' plans check their
    own model; an RL run checks when its roles build, which --dry_run never reaches)."""
    from rlhfkit.config.rl import PPOConfig
    from rlhfkit.config.sequence_parallel import check_ring_heads
    from rlhfkit.planner.memory import read_model_shape

    if isinstance(cfg, PPOConfig) and cfg.strategy.ring_attn_size > 1 and cfg.model.pretrain:
        check_ring_heads(cfg.strategy.ring_attn_size, read_model_shape(cfg.model.pretrain, "--pretrain").num_heads)


def dry_run(cfg: TrainConfig, trainer: str, prog: str) -> bool:
    """--dry_run: print the memory plan of this validated config and return True (the caller exits 0 without
    loading a model); False without --dry_run. `trainer` is sft, rm, dpo, kto, ppo or ppo_ray."""
    plan_args = cfg.plan
    if not plan_args.dry_run:
        return False
    devices, world = _devices(plan_args)
    _check_rl_heads(cfg)
    if os.environ.get("RANK", "0") == "0":
        import torch

        step = step_time.describe(cfg, trainer, devices.kind, world, torch.get_num_threads())
        text = render(plan_with_advice(cfg, trainer, devices, world), prog)
        print(text if step is None else f"{text}\n{step}", flush=True)
    return True
