"""Helpers shared by tests (import as `from tests.helpers import ...`)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_module(args: list[str], *, launcher: list[str] | None = None, timeout: float = 300,
               env: dict[str, str] | None = None, cwd: str | None = None) -> subprocess.CompletedProcess:
    """Run `python -m ...` (or a launcher such as torchrun) as a real subprocess with test-safe settings."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    cmd = (launcher or [sys.executable, "-m"]) + args
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=cwd or REPO)


@contextmanager
def launcher_env_of_one() -> Iterator[None]:
    """The launcher variables of a world of one (RANK 0, WORLD_SIZE 1, a free MASTER_PORT) for code that joins a
    process group in this process (a DeepSpeed engine, an in-process trainer); the whole environment is restored
    afterwards, so later subprocesses never inherit RANK/WORLD_SIZE/MASTER_*."""
    from rlhfkit.distributed.launch import free_port

    saved = dict(os.environ)
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)
