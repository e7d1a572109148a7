"""Layout-free ("universal") training state of one engine, resumable at another ZeRO stage or world size.

A DeepSpeed checkpoint stores each rank's slice of the flattened parameters and optimizer states, so it loads only
into the same ZeRO stage and world size. With `--use_ds_universal_ckpt` an engine's state is stored instead by
parameter name: the full fp32 master weight and the full Adam moments of every trainable parameter (gathered
through DeepSpeed's tensor-fragment API, which covers ZeRO 1-3 and the bf16 optimizer; a plain optimizer's
parameters are read directly), the optimizer step, the LR schedule and the engine's step counters. Any engine with
the same parameter names loads it, whatever its partitioning. Frozen parameters (a LoRA base) are not stored: they
come unchanged from the model directory the run starts from.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from rlhfkit.distributed.optimizers import MuonWithAdamW
from rlhfkit.errors import UserError

UNIVERSAL_FILE = "universal_state.pt"
ADAM_STATES = ("exp_avg", "exp_avg_sq")
COUNTERS = ("global_steps", "global_samples", "skipped_steps")
# Where DeepSpeed's optimizers keep the flat fp32 partitions (ZeRO-1/2, ZeRO-3, bf16 optimizer)
FLAT_FP32_PARTITIONS = ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat", "fp32_groups_flat_partition")


def _inner_optimizer(engine: Any) -> torch.optim.Optimizer:
    """The torch optimizer the LR scheduler drives (inside ZeRO / bf16 wrappers)."""
    opt = engine.optimizer
    while not isinstance(opt, torch.optim.Optimizer) and getattr(opt, "optimizer", None) is not None:
        opt = opt.optimizer
    return opt


def _trainable(engine: Any) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]


def _full_fp32(engine: Any, p: nn.Parameter, key: str | None) -> torch.Tensor:
    """The full fp32 master weight (key None) or Adam moment of `p`; a collective call under ZeRO."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    value = safe_get_full_fp32_param(p) if key is None else safe_get_full_optimizer_state(p, key)
    if value is None:  # no ZeRO partitioning: the optimizer works on the parameter itself
        value = p.detach() if key is None else _inner_optimizer(engine).state[p][key]
    return value.detach().float().cpu().clone()


def _set_full_fp32(engine: Any, p: nn.Parameter, value: torch.Tensor, key: str | None) -> None:
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    if hasattr(p, "ds_id") or hasattr(p, "_hp_mapping"):
        if key is None:
            safe_set_full_fp32_param(p, value)
        else:
            safe_set_full_optimizer_state(p, value, key)
    elif key is not None:
        _inner_optimizer(engine).state[p][key].copy_(value)
    if key is None:  # the model's own (possibly bf16, possibly partitioned) copy of the weight
        _set_model_weight(p, value)


def _set_model_weight(p: nn.Parameter, value: torch.Tensor) -> None:
    if hasattr(p, "ds_id"):  # ZeRO-3: gather, overwrite, and let DeepSpeed re-partition on exit
        import deepspeed

        with deepspeed.zero.GatheredParameters([p], modifier_rank=0):
            p.data.copy_(value.to(p.dtype))
    else:
        p.data.copy_(value.to(p.dtype))


def _optimizer_step(opt: torch.optim.Optimizer) -> float:
    for state in opt.state.values():
        if "step" in state:
            return float(state["step"])
    return 0.0


def _ensure_adam_state(engine: Any) -> None:
    """Torch's Adam creates its state at the first step (under ZeRO too: the flat fp32 partitions are its
    parameters); a fresh engine has none to fill. Create it, and link ZeRO-1/2 / bf16 parameter fragments to it as
    DeepSpeed does after its first step."""
    opt = _inner_optimizer(engine)
    flats = [p for group in opt.param_groups for p in group["params"]]
    for attr in FLAT_FP32_PARTITIONS:  # ZeRO swaps these in as Adam's parameters at each step
        flats += [p for p in getattr(engine.optimizer, attr, None) or [] if p is not None]
    for p in flats:
        if not opt.state.get(p):
            opt.state[p] = {"step": torch.tensor(0.0), **{k: torch.zeros_like(p) for k in ADAM_STATES}}
    _link_fragments(engine)


def _link_fragments(engine: Any) -> None:
    """Point ZeRO-1/2 / bf16 parameter fragments at the optimizer state (what the fragment API reads). DeepSpeed
    0.19 links them once, after the FIRST param group's first step, so later groups (the no-decay group) stay
    unlinked; link again now that every group has state."""
    opt = engine.optimizer
    if hasattr(opt, "_hp_optimizer_states_linked") and hasattr(opt, "_lazy_init_hp_params_optimizer_state"):
        opt._hp_optimizer_states_linked = False
        opt._lazy_init_hp_params_optimizer_state()


def save_universal_state(engine: Any, path: Path, is_rank0: bool) -> None:
    """Write `engine`'s layout-free state to `path` (rank 0 writes; every rank must call: ZeRO gathers)."""
    _link_fragments(engine)
    saved: dict[str, Any] = {"params": {}, **{k: {} for k in ADAM_STATES}}
    for name, p in _trainable(engine):
        values = {key: _full_fp32(engine, p, key) for key in (None, *ADAM_STATES)}
        if is_rank0:
            saved["params"][name] = values[None]
            for key in ADAM_STATES:
                saved[key][name] = values[key]
    if not is_rank0:
        return
    scheduler = getattr(engine, "lr_scheduler", None)
    saved.update(step=_optimizer_step(_inner_optimizer(engine)),
                 scheduler=scheduler.state_dict() if scheduler is not None else None,
                 counters={k: getattr(engine, k) for k in COUNTERS if hasattr(engine, k)})
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(saved, path)


def load_universal_state(engine: Any, path: Path) -> None:
    """Load a `save_universal_state` file into `engine` (every rank reads it; ZeRO stage and world size free)."""
    saved = torch.load(path, map_location="cpu", weights_only=False)
    trainable = _trainable(engine)
    missing = sorted({n for n, _ in trainable} - set(saved["params"]))
    if missing:
        raise RuntimeError(f"universal checkpoint {path} has no state for {len(missing)} trainable parameter(s), "
                           f"e.g. {missing[0]}: it was written for a different model or LoRA setting")
    _ensure_adam_state(engine)
    for name, p in trainable:
        _set_full_fp32(engine, p, saved["params"][name], None)
        for key in ADAM_STATES:
            _set_full_fp32(engine, p, saved[key][name], key)
    opt = _inner_optimizer(engine)
    for state in opt.state.values():
        if "step" in state:
            step = state["step"]
            state["step"] = torch.full_like(step, saved["step"]) if torch.is_tensor(step) else int(saved["step"])
    scheduler = getattr(engine, "lr_scheduler", None)
    if scheduler is not None and saved["scheduler"] is not None:
        scheduler.load_state_dict(saved["scheduler"])
        for group, lr in zip(opt.param_groups, scheduler.get_last_lr()):
            group["lr"] = lr  # the optimizer's lr is set by scheduler.step(); resume where the schedule stood
    for key, value in saved["counters"].items():
        setattr(engine, key, value)


def save_engine_state(engine: Any, save_dir: str, tag: str, universal: bool, is_rank0: bool) -> None:
    """The engine's resumable state under save_dir/tag: DeepSpeed's own checkpoint, or the universal file."""
    if universal:
        if isinstance(_inner_optimizer(engine), MuonWithAdamW):
            raise UserError("--use_ds_universal_ckpt stores Adam moments and Muon keeps a momentum buffer; Muon runs "
                            "resume from their own checkpoints: drop --use_ds_universal_ckpt with --optim muon")
        save_universal_state(engine, Path(save_dir) / tag / UNIVERSAL_FILE, is_rank0)
    else:
        engine.save_checkpoint(save_dir, tag=tag, save_latest=False)


def load_engine_state(engine: Any, load_dir: str, tag: str) -> bool:
    """Restore what `save_engine_state` wrote (either form, told apart by the files); False when nothing is there."""
    universal = Path(load_dir) / tag / UNIVERSAL_FILE
    if universal.is_file():
        load_universal_state(engine, universal)
        return True
    path, _ = engine.load_checkpoint(load_dir, tag=tag)
    return path is not None
