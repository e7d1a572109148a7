"""Atomic resumable checkpoints of DeepSpeed engines plus trainer state (data position, RNG).

Layout: `<ckpt_path>/global_step<N>/` holds each engine under its own name (`actor/`, `critic/`, ...), the
trainer's `state.json` and one `rng_rank<R>.pt` per rank. A checkpoint is written under
`<ckpt_path>/.incomplete/` and renamed into place only once every rank has finished, and `latest` is replaced
atomically last: a crash mid-save leaves the previous checkpoint as the newest one.

An engine's state is DeepSpeed's own checkpoint (same ZeRO stage and world size to resume), or with
`--use_ds_universal_ckpt` the layout-free form of `rlhfkit.distributed.universal` (any stage, any world size);
loading tells the two apart by their files. Old checkpoints are pruned to `--max_ckpt_num` and to a total size of
`--max_ckpt_mem` GB, oldest first; the newest one is always kept.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from rlhfkit.distributed.strategy import DeepSpeedStrategy, RngState
from rlhfkit.distributed.universal import load_engine_state, save_engine_state

LATEST = "latest"
INCOMPLETE = ".incomplete"


def _step_dirs(root: Path) -> list[Path]:
    dirs = [p for p in root.glob("global_step*") if p.is_dir() and p.name[len("global_step"):].isdigit()]
    return sorted(dirs, key=lambda p: int(p.name[len("global_step"):]))


def _is_engine(target: Any) -> bool:
    """A DeepSpeed engine itself (a torch module), as opposed to a role object or Ray group that saves its own."""
    return isinstance(target, torch.nn.Module)


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def prune_checkpoints(root: Path, max_keep: int, max_gb: float) -> list[Path]:
    """Remove the oldest checkpoints until at most `max_keep` remain and they total at most `max_gb` GB (the newest
    stays even when it alone is larger). Returns what was removed."""
    dirs = _step_dirs(root)
    sizes = [dir_bytes(d) for d in dirs]
    removed = []
    while len(dirs) > 1 and (len(dirs) > max(max_keep, 1) or sum(sizes) > max_gb * 1024**3):
        removed.append(dirs.pop(0))
        sizes.pop(0)
        shutil.rmtree(removed[-1], ignore_errors=True)
    return removed


def save_checkpoint(strategy: DeepSpeedStrategy, ckpt_path: str, step: int, engines: dict[str, Any],
                    state: dict[str, Any], max_keep: int, *, max_gb: float = float("inf"),
                    universal: bool = False) -> Path:
    """Save engines (model, optimizer, scheduler), trainer `state` and per-rank RNG for `step`.

    `engines` maps names to DeepSpeed engines (saved here, universal or not) or to roles with an engine-like
    `save_checkpoint(dir, tag=..., save_latest=...)` that choose their form themselves."""
    root = Path(ckpt_path)
    tag = f"global_step{step}"
    staging = root / INCOMPLETE / tag
    if strategy.is_rank0:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True, exist_ok=True)
    strategy.barrier()
    for name, engine in engines.items():
        if _is_engine(engine):
            save_engine_state(engine, str(staging), name, universal, strategy.is_rank0)
        else:
            engine.save_checkpoint(str(staging), tag=name, save_latest=False)
    torch.save(RngState.capture().__dict__, staging / f"rng_rank{strategy.rank}.pt")
    strategy.barrier()
    final = root / tag
    if strategy.is_rank0:
        (staging / "state.json").write_text(json.dumps({**state, "global_step": step}, indent=1))
        if final.exists():
            shutil.rmtree(final)
        os.replace(staging, final)
        tmp = root / f"{LATEST}.tmp"
        tmp.write_text(tag)
        os.replace(tmp, root / LATEST)
        prune_checkpoints(root, max_keep, max_gb)
    strategy.barrier()
    return final


def latest_checkpoint(ckpt_path: str) -> Path | None:
    """The newest complete checkpoint directory, or None."""
    root = Path(ckpt_path)
    marker = root / LATEST
    if not marker.is_file():
        return None
    path = root / marker.read_text().strip()
    return path if path.is_dir() else None


def load_checkpoint(strategy: DeepSpeedStrategy, path: Path, engines: dict[str, Any]) -> dict[str, Any]:
    """Restore engines and this rank's RNG from `path`; return the trainer state saved with them."""
    for name, engine in engines.items():
        if _is_engine(engine):
            found = load_engine_state(engine, str(path), name)
        else:
            found = engine.load_checkpoint(str(path), tag=name)[0] is not None
        if not found:
            raise RuntimeError(f"checkpoint {path} has no state for {name}")
    rng_file = path / f"rng_rank{strategy.rank}.pt"
    if rng_file.is_file():
        RngState(**torch.load(rng_file, weights_only=False)).restore()
    return json.loads((path / "state.json").read_text())
