"""Atomic resumable checkpoints of DeepSpeed engines plus trainer state (data position, RNG).

Layout: `<ckpt_path>/global_step<N>/` holds each engine under its own name (`actor/`, `critic/`, ...), the
trainer's `state.json` and one `rng_rank<R>.pt` per rank. A checkpoint is written under
`<ckpt_path>/.incomplete/` and renamed into place only once every rank has finished, and `latest` is replaced
atomically last: a crash mid-save leaves the previous checkpoint as the newest one.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from rlhfkit.distributed.strategy import DeepSpeedStrategy, RngState

LATEST = "latest"
INCOMPLETE = ".incomplete"


def _step_dirs(root: Path) -> list[Path]:
    dirs = [p for p in root.glob("global_step*") if p.is_dir() and p.name[len("global_step"):].isdigit()]
    return sorted(dirs, key=lambda p: int(p.name[len("global_step"):]))


def save_checkpoint(strategy: DeepSpeedStrategy, ckpt_path: str, step: int, engines: dict[str, Any],
                    state: dict[str, Any], max_keep: int) -> Path:
    """Save engines (model, optimizer, scheduler), trainer `state` and per-rank RNG for `step`."""
    root = Path(ckpt_path)
    tag = f"global_step{step}"
    staging = root / INCOMPLETE / tag
    if strategy.is_rank0:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True, exist_ok=True)
    strategy.barrier()
    for name, engine in engines.items():
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
        for old in _step_dirs(root)[:-max(max_keep, 1)]:
            shutil.rmtree(old, ignore_errors=True)
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
        load_path, _ = engine.load_checkpoint(str(path), tag=name)
        if load_path is None:
            raise RuntimeError(f"checkpoint {path} has no state for {name}")
    rng_file = path / f"rng_rank{strategy.rank}.pt"
    if rng_file.is_file():
        RngState(**torch.load(rng_file, weights_only=False)).restore()
    return json.loads((path / "state.json").read_text())
