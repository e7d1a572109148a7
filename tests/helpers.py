"""Helpers shared by tests (import as `from tests.helpers import ...`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_module(args: list[str], *, launcher: list[str] | None = None, timeout: float = 300,
               env: dict[str, str] | None = None, cwd: str | None = None) -> subprocess.CompletedProcess:
    """Run `python -m ...` (or a launcher such as torchrun) as a real subprocess with test-safe settings."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    cmd = (launcher or [sys.executable, "-m"]) + args
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=cwd or REPO)
