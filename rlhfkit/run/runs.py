"""Which run a checkpoint belongs to, whether it is complete, and whether this run may resume it.

Every checkpoint directory carries `rlhfkit_ckpt.json`: the run id, the trainer, the run's config (as a dict), the
rlhfkit version and a manifest (relative path -> size) of every file written before it. The manifest is what
makes a truncated or half-copied checkpoint detectable without loading it; the run id is what keeps rotation
(`--max_ckpt_num`) inside the current run and lets a new run refuse a directory that holds another run's work.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlhfkit import __version__
from rlhfkit.distributed.universal import UNIVERSAL_FILE
from rlhfkit.errors import UserError
from rlhfkit.run.resume_rules import plan_resume

META = "rlhfkit_ckpt.json"
LATEST = "latest"
INCOMPLETE = ".incomplete"
STEP_PREFIX = "global_step"

@dataclass
class RunInfo:
    """Identity of a training run, written into each of its checkpoints. A resumed run adopts the id it resumes."""

    trainer: str
    config: dict[str, Any] = field(default_factory=dict)
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:16])
    version: str = __version__


def step_of(path: Path) -> int:
    return int(path.name[len(STEP_PREFIX):])


def step_dirs(root: Path) -> list[Path]:
    """Checkpoint directories in `root`, oldest step first."""
    dirs = [p for p in root.glob(f"{STEP_PREFIX}*") if p.is_dir() and p.name[len(STEP_PREFIX):].isdigit()]
    return sorted(dirs, key=step_of)


def read_meta(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads((path / META).read_text())
    except (OSError, ValueError):
        return None


def manifest(path: Path) -> dict[str, int]:
    return {str(f.relative_to(path)): f.stat().st_size for f in sorted(path.rglob("*")) if f.is_file()
            and f.name != META}


def write_meta(path: Path, run: RunInfo, step: int) -> None:
    """Written last into a finished staging directory: its manifest covers every other file."""
    meta = {"run_id": run.run_id, "trainer": run.trainer, "version": run.version, "global_step": step,
            "config": run.config, "files": manifest(path)}
    tmp = path / f"{META}.tmp"
    tmp.write_text(json.dumps(meta, indent=1, default=str))
    os.replace(tmp, path / META)


def problem(path: Path) -> str | None:
    """Why the checkpoint at `path` cannot be resumed (missing or truncated files), or None when it is whole.
    Checkpoints written before run metadata existed are accepted when their state.json reads."""
    meta = read_meta(path)
    if meta is None:
        if (path / META).exists():
            return f"{META} is unreadable"
        try:
            json.loads((path / "state.json").read_text())
        except (OSError, ValueError):
            return "state.json is missing or unreadable"
        return None
    for rel, size in meta.get("files", {}).items():
        f = path / rel
        if not f.is_file():
            return f"{rel} is missing"
        if f.stat().st_size != size:
            return f"{rel} is truncated ({f.stat().st_size} of {size} bytes)"
    return None


def run_of(path: Path) -> str | None:
    meta = read_meta(path)
    return meta.get("run_id") if meta else None


def is_universal(meta: dict[str, Any]) -> bool:
    """Every engine of the checkpoint is in the layout-free form (`--use_ds_universal_ckpt`), by its manifest."""
    files = [Path(rel).name for rel in meta.get("files", {})]
    return UNIVERSAL_FILE in files and not any(f.endswith("_states.pt") for f in files)


def check_compatible(path: Path, run: RunInfo) -> list[str]:
    """Raise UserError (one line naming each flag) when the checkpoint at `path` is not this run's to resume: another
    trainer, or a change `rlhfkit.run.resume_rules` refuses. Return lines to print: conversions and warnings."""
    meta = read_meta(path)
    if meta is None:
        return [f"{path} predates run metadata: its trainer and config cannot be checked"]
    if meta.get("trainer") != run.trainer:
        raise UserError(f"--load_checkpoint: {path} was written by {meta.get('trainer')}, not {run.trainer}; "
                        f"point --ckpt_path at a {run.trainer} run's checkpoints (or start one without "
                        "--load_checkpoint and another --ckpt_path)")
    plan = plan_resume(meta.get("config") or {}, run.config, universal=is_universal(meta))
    if plan.refused:
        raise UserError(f"--load_checkpoint: {path} cannot be resumed: {'; '.join(plan.refused)}; or start a new "
                        "run with another --ckpt_path")
    notes = [f"converting: {line}" for line in plan.converted]
    if plan.warned:
        notes.append("warning: resuming with changed settings: " + ", ".join(plan.warned))
    if meta.get("version") != run.version:
        notes.append(f"warning: {path} was written by rlhfkit {meta.get('version')}, this is {run.version}")
    return notes


def claim_ckpt_dir(ckpt_path: str, *, resume: bool, overwrite: bool, rank0: bool) -> list[str]:
    """Before any work: refuse a --ckpt_path holding another run's checkpoints unless resuming (--load_checkpoint;
    compatibility is checked when the checkpoint is read) or overwriting (--overwrite_ckpt deletes them).
    Removes leftovers of interrupted saves. Returns lines to print."""
    root = Path(ckpt_path)
    if not root.is_dir():
        return []
    notes: list[str] = []
    if rank0:
        shutil.rmtree(root / INCOMPLETE, ignore_errors=True)
    existing = step_dirs(root)
    if not existing or resume:
        return notes
    newest = existing[-1]
    meta = read_meta(newest) or {}
    if not overwrite:
        owner = f"a {meta['trainer']} run" if meta.get("trainer") else "another run"
        raise UserError(f"--ckpt_path {ckpt_path} already holds checkpoints of {owner} (newest: {newest.name}); "
                        "add --load_checkpoint to resume it, --overwrite_ckpt to delete them, or choose another "
                        "--ckpt_path")
    if rank0:
        for d in existing:
            shutil.rmtree(d)
        (root / LATEST).unlink(missing_ok=True)
    notes.append(f"--overwrite_ckpt: removed {len(existing)} checkpoint(s) of an earlier run from {ckpt_path}")
    return notes
