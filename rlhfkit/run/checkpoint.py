"""Kill-safe resumable checkpoints of DeepSpeed engines plus trainer state (data position, RNG).

Layout: `<ckpt_path>/global_step<N>/` holds each engine under its own name (`actor/`, `critic/`, ...), the
trainer's `state.json`, one `rng_rank<R>.pt` per process (R: its global rank) and `rlhfkit_ckpt.json` (run id,
trainer, config, version, manifest of the other files: `rlhfkit.run.runs`). A checkpoint is written under
`<ckpt_path>/.incomplete/` and renamed into place only once every rank has finished and its manifest is written;
`latest` is replaced atomically after that. A SIGKILL at any moment therefore leaves complete checkpoints only,
and resume takes the newest one whose files match its manifest (saying so when `latest` is missing or points
elsewhere).

An engine's state is DeepSpeed's own checkpoint (same ZeRO stage and world size to resume), or with
`--use_ds_universal_ckpt` the layout-free form of `rlhfkit.distributed.universal` (any stage, any world size);
loading tells the two apart by their files. Rotation (`--max_ckpt_num`, `--max_ckpt_mem` GB) removes the oldest
checkpoints of the current run only; the newest is always kept, and other runs' checkpoints are never touched.

Test hook (`rlhfkit.run.pause_points`): `RLHFKIT_TEST_PAUSE=ckpt@<step>:<file>` pauses rank 0 when the
checkpoint of <step> is fully written but not yet renamed into place, so a test can SIGKILL the save there.
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
from rlhfkit.errors import UserError
from rlhfkit.run.pause_points import pause_point
from rlhfkit.run.runs import (
    INCOMPLETE,
    LATEST,
    RunInfo,
    check_compatible,
    problem,
    run_of,
    step_dirs,
    write_meta,
)


def _is_engine(target: Any) -> bool:
    """A DeepSpeed engine itself (a torch module), as opposed to a role object or Ray group that saves its own."""
    return isinstance(target, torch.nn.Module)


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def prune_checkpoints(root: Path, max_keep: int, max_gb: float, run_id: str | None = None) -> list[Path]:
    """Remove the oldest checkpoints until at most `max_keep` remain and they total at most `max_gb` GB (the newest
    stays even when it alone is larger). With `run_id`, only that run's checkpoints count and are removed.
    Returns what was removed."""
    dirs = [d for d in step_dirs(root) if run_id is None or run_of(d) == run_id]
    sizes = [dir_bytes(d) for d in dirs]
    removed = []
    while len(dirs) > 1 and (len(dirs) > max(max_keep, 1) or sum(sizes) > max_gb * 1024**3):
        removed.append(dirs.pop(0))
        sizes.pop(0)
        shutil.rmtree(removed[-1], ignore_errors=True)
    return removed


def process_rank() -> int:
    """This process's global rank (0 without a process group)."""
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def rng_file(directory: Path) -> Path:
    """This process's RNG state file in a checkpoint directory. Named by the global rank, not `strategy.rank`:
    the ranks of a tensor-parallel group share `strategy.rank` (one data-parallel rank) but each has generators of
    its own, and under one name they would overwrite each other's file and resume from the same state."""
    return directory / f"rng_rank{process_rank()}.pt"


def save_checkpoint(strategy: DeepSpeedStrategy, ckpt_path: str, step: int, engines: dict[str, Any],
                    state: dict[str, Any], max_keep: int, *, max_gb: float = float("inf"),
                    universal: bool = False, run: RunInfo | None = None) -> Path:
    """Save engines (model, optimizer, scheduler), trainer `state` and per-rank RNG for `step`.

    `engines` maps names to DeepSpeed engines (saved here, universal or not) or to roles with an engine-like
    `save_checkpoint(dir, tag=..., save_latest=...)` that choose their form themselves."""
    run = run or RunInfo("unknown")
    root = Path(ckpt_path)
    tag = f"global_step{step}"
    pending = root / INCOMPLETE
    staging = pending / tag
    if strategy.is_rank0:
        shutil.rmtree(pending, ignore_errors=True)  # leftovers of a save that was killed
        staging.mkdir(parents=True, exist_ok=True)
    strategy.barrier()
    for name, engine in engines.items():
        if _is_engine(engine):
            save_engine_state(engine, str(staging), name, universal, strategy.is_rank0)
        else:
            engine.save_checkpoint(str(staging), tag=name, save_latest=False)
    torch.save(RngState.capture().__dict__, rng_file(staging))
    strategy.barrier()
    final = root / tag
    if strategy.is_rank0:
        (staging / "state.json").write_text(json.dumps({**state, "global_step": step}, indent=1))
        write_meta(staging, run, step)
        pause_point("ckpt", step)
        if final.exists():  # the same step again (a resume after a newer checkpoint was found corrupt)
            old = pending / f"replaced_{tag}"
            os.replace(final, old)
        os.replace(staging, final)
        tmp = root / f"{LATEST}.tmp"
        tmp.write_text(tag)
        os.replace(tmp, root / LATEST)
        shutil.rmtree(pending, ignore_errors=True)
        prune_checkpoints(root, max_keep, max_gb, run_id=run.run_id)
    strategy.barrier()
    return final


def resumable_checkpoints(ckpt_path: str) -> tuple[list[Path], list[str]]:
    """Complete checkpoints, newest first, and notes on what was skipped (a corrupt newest one, `latest` missing
    or pointing elsewhere)."""
    root = Path(ckpt_path)
    notes, good = [], []
    for d in reversed(step_dirs(root)):
        why = problem(d)
        if why is None:
            good.append(d)
        else:
            notes.append(f"skipping {d}: {why}")
    marker = root / LATEST
    pointed = marker.read_text().strip() if marker.is_file() else None
    if good and pointed != good[0].name:
        said = f"points at {pointed}" if pointed else "is missing"
        notes.append(f"{root / LATEST} {said}; resuming from the newest complete checkpoint, {good[0].name}")
    return good, notes


def none_resumable(ckpt_path: str, why: list[str]) -> UserError:
    """The one-line error for a --ckpt_path whose every checkpoint is damaged (`why`: the reason for each)."""
    return UserError(f"--load_checkpoint: none of the {len(why)} checkpoint(s) in {ckpt_path} can be resumed "
                     f"({'; '.join(why)}); start over with --overwrite_ckpt instead of --load_checkpoint, or use "
                     "another --ckpt_path")


def latest_checkpoint(ckpt_path: str) -> Path | None:
    """The newest complete checkpoint directory, or None when there is none; UserError when there are checkpoints
    but every one is damaged."""
    good, _ = resumable_checkpoints(ckpt_path)
    if not good and (dirs := step_dirs(Path(ckpt_path))):
        raise none_resumable(ckpt_path, [f"{d.name}: {problem(d)}" for d in reversed(dirs)])
    return good[0] if good else None


def load_checkpoint(strategy: DeepSpeedStrategy, path: Path, engines: dict[str, Any]) -> dict[str, Any]:
    """Restore engines and this rank's RNG from `path`; return the trainer state saved with them."""
    for name, engine in engines.items():
        if _is_engine(engine):
            found = load_engine_state(engine, str(path), name)
        else:
            found = engine.load_checkpoint(str(path), tag=name)[0] is not None
        if not found:
            raise RuntimeError(f"checkpoint {path} has no state for {name}")
    rng = rng_file(path)
    if rng.is_file():
        RngState(**torch.load(rng, weights_only=False)).restore()
    return json.loads((path / "state.json").read_text())


def resume(strategy: DeepSpeedStrategy, ckpt_path: str, engines: dict[str, Any],
           run: RunInfo) -> tuple[Path, dict[str, Any]] | None:
    """Load the newest complete checkpoint this run may resume: refuse another trainer's or another model's
    (UserError), warn about other changed settings, fall back to an older checkpoint when the newest fails to
    load. The run adopts the resumed run's id (so rotation continues over its checkpoints). None: nothing to
    resume."""
    newest = latest_checkpoint(ckpt_path)  # every checkpoint damaged: UserError
    good, notes = resumable_checkpoints(ckpt_path)
    if newest is not None:
        notes += check_compatible(newest, run)
    for note in notes:
        strategy.print(note)
    failures = [f"{d.name}: {why}" for d in reversed(step_dirs(Path(ckpt_path))) if (why := problem(d))]
    for i, path in enumerate(good):
        try:
            state = load_checkpoint(strategy, path, engines)
        except UserError:
            raise
        except Exception as e:  # noqa: BLE001 - a damaged file the manifest could not see: try the previous one
            failures.append(f"{path.name}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            if i + 1 == len(good):
                raise none_resumable(ckpt_path, failures) from e
            strategy.print(f"could not load {path} ({type(e).__name__}: {e}); falling back to {good[i + 1]}")
            continue
        run.run_id = run_of(path) or run.run_id
        return path, state
    return None
