"""Layout-free ("universal") training state of one engine, resumable at another ZeRO stage or world size.

A DeepSpeed checkpoint stores each rank's slice of the flattened parameters and optimizer states, so it loads only
into the same ZeRO stage and world size. With `--use_ds_universal_ckpt` an engine's state is stored instead by
parameter name and element range: every rank writes the part it holds of each trainable parameter's fp32 master
weight and Adam moments, with the offset of that part in the flattened parameter (`universal_shard_rank<R>.pt`);
rank 0 adds the layout-free rest (`universal_state.pt`: shapes, optimizer step, LR schedule, step counters). A
loading rank asks, parameter by parameter, for the element range its own layout gives it and copies it out of the
overlapping saved parts, whatever world size and stage wrote them. No rank gathers the model:

- save: each rank writes views of the tensors it already holds (torch.save writes their storage as is: no copy);
- load: the shard files are memory-mapped and a rank copies out only the ranges it asks for, one parameter at a
  time, into the tensors it already holds (the whole parameter where its layout keeps the model's weight whole:
  ZeRO 0-2 replicate it); the mappings are dropped every REMAP_BYTES read, so the pages they map stay bounded.

Where a part lives: a ZeRO-3 partition (`safe_get_local_*`), a ZeRO-1/2 or bf16-optimizer fragment
(`_hp_mapping`), the fp32 master copy of DeepSpeed's unfused bf16 optimizer (bf16 at ZeRO-0, `fp32_groups`), or the
parameter itself (fp32 at ZeRO-0 and the plain-torch engine); the last two are whole on every rank, so rank 0
writes them. Why not DeepSpeed's own `ds_to_universal`: it is an offline conversion of a finished ZeRO checkpoint
(one more process and a second copy of the checkpoint on disk per save), and its loader has no ZeRO-0 or
plain-torch path, both of which rlhfkit resumes into. Frozen parameters (a LoRA base) are not stored: they come
unchanged from the model directory the run starts from.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from rlhfkit.distributed.optimizers import MuonWithAdamW
from rlhfkit.errors import UserError

UNIVERSAL_FILE = "universal_state.pt"  # rank 0's: shapes, optimizer step, schedule, counters
SHARD_FILE = "universal_shard_rank{rank:05d}.pt"  # each rank's parts of the weights and moments
ADAM_STATES = ("exp_avg", "exp_avg_sq")
KEYS = ("fp32", *ADAM_STATES)  # what a part holds; "fp32" is the master weight
REMAP_BYTES = 32 * 2**20  # read through the shard files' mappings before they are dropped (SavedParts)
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


def _shape(p: Any) -> torch.Size:
    return p.ds_shape if hasattr(p, "ds_shape") else p.shape  # a ZeRO-3 parameter's own shape is empty


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _masters(optimizer: Any) -> dict[int, torch.Tensor]:
    """id(bf16 parameter) -> the fp32 copy Adam updates, for DeepSpeed's unfused bf16/fp16 optimizer (its ZeRO-0
    path): that copy, not the rounded parameter, is the weight to save, and Adam's state is keyed by it."""
    lows, highs = getattr(optimizer, "fp16_groups", None), getattr(optimizer, "fp32_groups", None)
    if not lows or not highs or not isinstance(highs[0], list):
        return {}
    return {id(lo): hi for low, high in zip(lows, highs) for lo, hi in zip(low, high)}


class LocalParts:
    """This rank's part of each trainable parameter's fp32 weight and Adam moments: where it starts in the
    flattened parameter, how many elements, and reading and writing them, whatever holds them. (`p: Any`: DeepSpeed
    adds its attributes, `ds_tensor`, `_hp_mapping`, ..., to the parameters at run time.)"""

    def __init__(self, engine: Any, rank: int):
        self.engine, self.rank = engine, rank
        self.opt = _inner_optimizer(engine)
        self.masters = _masters(engine.optimizer)

    def span(self, p: Any, saving: bool) -> tuple[int, int]:
        """(start, numel) of the elements this rank holds; a whole replicated parameter is saved by rank 0 only."""
        if hasattr(p, "ds_id"):  # ZeRO-3: rank r holds [r * size, (r + 1) * size), the last one padded
            size = p.ds_tensor.numel()
            start = self.rank * size
            return start, max(0, min(size, p.ds_numel - start))
        if hasattr(p, "_hp_mapping"):  # ZeRO-1/2, bf16 optimizer: None where this rank holds none of it
            address = p._hp_mapping.lp_fragment_address if p._hp_mapping is not None else None
            return (0, 0) if address is None else (address.start, address.numel)
        return 0, (0 if saving and self.rank != 0 else p.numel())

    def _whole(self, p: Any) -> torch.Tensor:
        return self.masters.get(id(p), p)

    def get(self, p: Any, key: str) -> torch.Tensor:
        """A view of this rank's part (no copy: torch.save writes the storage it views)."""
        from deepspeed.utils import safe_get_local_fp32_param, safe_get_local_optimizer_state

        _, numel = self.span(p, saving=True)
        if hasattr(p, "ds_id"):
            part = safe_get_local_fp32_param(p) if key == "fp32" else safe_get_local_optimizer_state(p, key)
        elif hasattr(p, "_hp_mapping"):
            part = p._hp_mapping.get_hp_fragment(None if key == "fp32" else key)
        else:
            whole = self._whole(p)
            part = whole if key == "fp32" else self.opt.state[whole][key]
        return part.detach().reshape(-1).narrow(0, 0, numel)

    def set(self, p: Any, key: str, value: torch.Tensor) -> None:
        """Overwrite this rank's part with `value` (its `span(p, saving=False)` elements)."""
        from deepspeed.utils import safe_set_local_fp32_param, safe_set_local_optimizer_state

        if hasattr(p, "ds_id"):
            padded = torch.zeros(p.ds_tensor.numel(), dtype=torch.float32)
            padded[: value.numel()] = value
            if key == "fp32":
                safe_set_local_fp32_param(p, padded)
            else:
                safe_set_local_optimizer_state(p, padded, key)
        elif hasattr(p, "_hp_mapping"):
            if p._hp_mapping is not None:
                p._hp_mapping.get_hp_fragment(None if key == "fp32" else key).data.copy_(value)
        else:
            whole = self._whole(p)
            target = whole if key == "fp32" else self.opt.state[whole][key]
            target.data.copy_(value.view_as(target))

    def set_weight(self, p: Any, read: Callable[[int, int], torch.Tensor]) -> None:
        """The model's own (possibly bf16) copy of the weight, from `read(start, numel)` of the saved fp32 one: the
        partition under ZeRO-3 (and the whole where it is gathered now), the whole weight otherwise."""
        if hasattr(p, "ds_id"):
            start, numel = self.span(p, saving=False)
            p.ds_tensor.data.zero_()
            p.ds_tensor.data[:numel].copy_(read(start, numel))
            if p.data.numel() == p.ds_numel:  # gathered now (a small persistent parameter after its first use)
                p.data.copy_(read(0, p.ds_numel).view(p.ds_shape))
        elif p is not self._whole(p) or hasattr(p, "_hp_mapping"):
            p.data.copy_(read(0, p.numel()).view_as(p))


def _link_fragments(engine: Any) -> None:
    """Point ZeRO-1/2 / bf16 parameter fragments at the optimizer state (what the fragment API reads). DeepSpeed
    0.19 links them once, after the FIRST param group's first step, so later groups (the no-decay group) stay
    unlinked; link again now that every group has state."""
    opt = engine.optimizer
    if hasattr(opt, "_hp_optimizer_states_linked") and hasattr(opt, "_lazy_init_hp_params_optimizer_state"):
        opt._hp_optimizer_states_linked = False
        opt._lazy_init_hp_params_optimizer_state()


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


def _optimizer_step(opt: torch.optim.Optimizer) -> float:
    for state in opt.state.values():
        if "step" in state:
            return float(state["step"])
    return 0.0


def save_universal_state(engine: Any, folder: Path, rank: int | None = None) -> None:
    """Write this rank's parts of `engine`'s state under `folder` (every rank calls; no collective)."""
    rank = _rank() if rank is None else rank
    _link_fragments(engine)
    parts = LocalParts(engine, rank)
    shard: dict[str, dict[str, Any]] = {}
    for name, p in _trainable(engine):
        start, numel = parts.span(p, saving=True)
        if numel:
            shard[name] = {"start": start, **{key: parts.get(p, key) for key in KEYS}}
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(shard, folder / SHARD_FILE.format(rank=rank))
    if rank != 0:
        return
    scheduler = getattr(engine, "lr_scheduler", None)
    torch.save({"format": 2, "world_size": dist.get_world_size() if dist.is_initialized() else 1,
                "shapes": {name: list(_shape(p)) for name, p in _trainable(engine)},
                "step": _optimizer_step(_inner_optimizer(engine)),
                "scheduler": scheduler.state_dict() if scheduler is not None else None,
                "counters": {k: getattr(engine, k) for k in COUNTERS if hasattr(engine, k)}},
               folder / UNIVERSAL_FILE)


class SavedParts:
    """The saved parts of every rank, memory-mapped: `read` copies out one element range of one parameter.

    A mapped page stays resident while its mapping lives, and the kernel maps pages around each one read (read-around
    and fault-around: measured, reading a quarter of each part mapped 1.7x that), so `release` drops the mappings
    once REMAP_BYTES have been read through them; the next `read` maps the files again (unpickling their index only).
    """

    def __init__(self, folder: Path, meta: dict[str, Any]):
        self.files: list[Path] = []
        self.touched = 0
        if "params" in meta:  # the single-file form of rlhfkit before sharding: rank 0 held every tensor whole
            self._shards = [{n: {"start": 0, **{k: meta["params" if k == "fp32" else k][n].reshape(-1) for k in KEYS}}
                             for n in meta["params"]}]
            self.shapes = {n: list(t.shape) for n, t in meta["params"].items()}
            return
        self.files = sorted(folder.glob(SHARD_FILE.replace("{rank:05d}", "*")))
        if len(self.files) != meta["world_size"]:
            raise RuntimeError(f"universal checkpoint {folder} has {len(self.files)} of its {meta['world_size']} "
                               "shards")
        self._shards = []
        self.shapes = meta["shapes"]

    def shards(self) -> list[dict[str, Any]]:
        if not self._shards:
            self._shards = [torch.load(f, map_location="cpu", mmap=True, weights_only=True) for f in self.files]
        return self._shards

    def release(self) -> None:
        if self.files and self.touched >= REMAP_BYTES:
            self._shards, self.touched = [], 0

    def read(self, name: str, key: str, start: int, numel: int) -> torch.Tensor:
        out = torch.empty(numel, dtype=torch.float32)
        covered = 0
        for shard in self.shards():
            part = shard.get(name)
            if part is None:
                continue
            lo, hi = max(start, part["start"]), min(start + numel, part["start"] + part[key].numel())
            if hi > lo:
                out[lo - start: hi - start] = part[key][lo - part["start"]: hi - part["start"]]
                covered += hi - lo
        if covered != numel:
            raise RuntimeError(f"universal checkpoint: {name} {key} covers {covered} of elements [{start}, "
                               f"{start + numel}); a shard is missing or damaged")
        self.touched += 4 * numel
        return out


def _check_shapes(engine: Any, saved: SavedParts, folder: Path) -> None:
    trainable = _trainable(engine)
    missing = sorted({n for n, _ in trainable} - set(saved.shapes))
    if missing:
        raise RuntimeError(f"universal checkpoint {folder} has no state for {len(missing)} trainable parameter(s), "
                           f"e.g. {missing[0]}: it was written for a different model or LoRA setting")
    for name, p in trainable:
        if list(saved.shapes[name]) != list(_shape(p)):
            raise RuntimeError(f"universal checkpoint {folder}: {name} has shape {saved.shapes[name]}, the model's "
                               f"is {list(_shape(p))}: it was written for a different model")


def _restore_schedule(engine: Any, meta: dict[str, Any]) -> None:
    opt = _inner_optimizer(engine)
    for state in opt.state.values():
        if "step" in state:
            step = state["step"]
            state["step"] = torch.full_like(step, meta["step"]) if torch.is_tensor(step) else int(meta["step"])
    scheduler = getattr(engine, "lr_scheduler", None)
    if scheduler is not None and meta["scheduler"] is not None:
        scheduler.load_state_dict(meta["scheduler"])
        for group, lr in zip(opt.param_groups, scheduler.get_last_lr()):
            group["lr"] = lr  # the optimizer's lr is set by scheduler.step(); resume where the schedule stood
    for key, value in meta["counters"].items():
        setattr(engine, key, value)


def load_universal_state(engine: Any, folder: Path, rank: int | None = None) -> None:
    """Load what `save_universal_state` wrote, at any world size and ZeRO stage (every rank; no collective)."""
    meta = torch.load(folder / UNIVERSAL_FILE, map_location="cpu", weights_only=False)
    saved = SavedParts(folder, meta)
    _check_shapes(engine, saved, folder)
    _ensure_adam_state(engine)
    parts = LocalParts(engine, _rank() if rank is None else rank)
    for name, p in _trainable(engine):
        start, numel = parts.span(p, saving=False)
        for key in KEYS:
            parts.set(p, key, saved.read(name, key, start, numel))
        parts.set_weight(p, lambda lo, n, name=name: saved.read(name, "fp32", lo, n))  # type: ignore[misc]
        saved.release()
    _restore_schedule(engine, meta)


def save_engine_state(engine: Any, save_dir: str, tag: str, universal: bool, is_rank0: bool) -> None:
    """The engine's resumable state under save_dir/tag: DeepSpeed's own checkpoint, or the universal shards."""
    if universal:
        if isinstance(_inner_optimizer(engine), MuonWithAdamW):
            raise UserError("--use_ds_universal_ckpt stores Adam moments and Muon keeps a momentum buffer; Muon runs "
                            "resume from their own checkpoints: drop --use_ds_universal_ckpt with --optim muon")
        save_universal_state(engine, Path(save_dir) / tag, 0 if is_rank0 else None)
    else:
        engine.save_checkpoint(save_dir, tag=tag, save_latest=False)


def load_engine_state(engine: Any, load_dir: str, tag: str) -> bool:
    """Restore what `save_engine_state` wrote (either form, told apart by the files); False when nothing is there."""
    folder = Path(load_dir) / tag
    if (folder / UNIVERSAL_FILE).is_file():
        load_universal_state(engine, folder)
        return True
    path, _ = engine.load_checkpoint(load_dir, tag=tag)
    return path is not None
