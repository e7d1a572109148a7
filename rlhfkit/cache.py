"""Where rlhfkit keeps what it derives once and reuses across runs: `cache_root()`.

`$RLHFKIT_CACHE_DIR` when set, else `${XDG_CACHE_HOME:-~/.cache}/rlhfkit`. Each user of the cache takes a folder of
its own under it: `gguf/` (converted GGUF models, `rlhfkit/models/gguf.py`), `real_model/` (the packages of the
real-model demo, `rlhfkit/cli/real_model_assets.py`), `package-map/` (Transformers' import-time package scan,
`rlhfkit/package_map.py`) and `cpu-gemm/` (this machine's fp32 GEMM kernel decision, `rlhfkit/models/cpu_gemm.py`).
Importable from every layer: `import rlhfkit` itself loads it (through package_map).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

CACHE_ENV = "RLHFKIT_CACHE_DIR"


def cache_root() -> Path:
    """The rlhfkit cache folder (module docstring); not created here, each user makes its own subfolder."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "rlhfkit"


def write_atomically(path: Path, text: str) -> None:
    """Write `text` to `path` through a temporary file renamed over it: processes that start together never read
    half a file. On OSError the temporary file is removed and the error raised."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise
