"""Make this CPU machine look like the GPU machine to Python (bench/gpu/run.sh puts this folder first on PYTHONPATH
in SMOKE mode): `ray`, `vllm` and `wandb` are absent there, so importing them fails here too, and every top-level
module a process imported is appended to $RLHFKIT_IMPORT_LOG at exit, for run.sh to list what the device must
provide."""

from __future__ import annotations

import atexit
import os
import sys

ABSENT = ("ray", "vllm", "wandb")  # wandb: absent there too; TRL and rlhfkit import it only if installed


class _Hide:
    """Wraps a meta-path finder so that it never finds the packages the GPU machine lacks: `import ray` then fails
    and `importlib.util.find_spec("ray")` gives None, as for a package that is not installed."""

    def __init__(self, finder: object) -> None:
        self.finder = finder

    def find_spec(self, name: str, path: object = None, target: object = None) -> object:
        if name.split(".")[0] in ABSENT or not hasattr(self.finder, "find_spec"):
            return None
        return self.finder.find_spec(name, path, target)

    def __getattr__(self, attr: str) -> object:
        return getattr(self.finder, attr)


def _log_imports() -> None:
    names = {m.split(".")[0] for m in list(sys.modules)} - set(sys.stdlib_module_names)
    with open(os.environ["RLHFKIT_IMPORT_LOG"], "a") as f:
        f.write("".join(f"{n}\n" for n in sorted(names) if not n.startswith("_")))


sys.meta_path[:] = [_Hide(f) for f in sys.meta_path]
if os.environ.get("RLHFKIT_IMPORT_LOG"):
    atexit.register(_log_imports)
