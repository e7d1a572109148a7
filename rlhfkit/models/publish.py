"""Atomic final model saves: a kill mid-save never leaves a directory that loads as a model but lacks its weights
or its tokenizer.

The save path is also the run directory (metrics, run report, by default the checkpoints), so it cannot be
swapped for a new directory by one rename. Instead the model is written to a staging directory next to it, then
moved in file by file with the invariant that `config.json` (what `from_pretrained` needs first) is removed before
anything else moves and comes back last: at every instant the directory is either not a model at all or the
complete new one.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

WEIGHT_PATTERNS = ("model*.safetensors", "model*.safetensors.index.json", "pytorch_model*.bin",
                   "pytorch_model*.bin.index.json", "adapter_model*", "lora_adapter")


def staging_dir(path: str) -> Path:
    """A fresh, empty directory beside `path` (same filesystem, so the moves are renames)."""
    target = Path(path).resolve()
    staging = target.parent / f".{target.name}.saving"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    return staging


def publish_model_dir(staging: Path, path: str) -> None:
    """Move every file of the finished model in `staging` into `path`, config.json last (see the module doc)."""
    target = Path(path)
    target.mkdir(parents=True, exist_ok=True)
    (target / "config.json").unlink(missing_ok=True)
    new = {p.name for p in staging.iterdir()}
    for pattern in WEIGHT_PATTERNS:  # an older save's weights in another sharding must not mix with these
        for stale in target.glob(pattern):
            if stale.name not in new:
                shutil.rmtree(stale) if stale.is_dir() else stale.unlink()
    for name in sorted(new - {"config.json"}) + (["config.json"] if "config.json" in new else []):
        dst = target / name
        if dst.is_dir() and not dst.is_symlink():
            shutil.rmtree(dst)
        os.replace(staging / name, dst)
    staging.rmdir()
