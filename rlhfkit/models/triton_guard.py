"""Keep Triton out of processes whose PyTorch has no GPU backend.

Triton compiles GPU kernels. It gets installed on CPU machines too: vLLM's CPU build requires `xgrammar`, which
requires `triton` on Linux. Once installed, PyTorch imports it in every process that imports `torch._dynamo`, and
Transformers' modeling code imports `torch._dynamo` (its generation and masking utilities). On a PyTorch built
without CUDA, ROCm or XPU, nothing can run a Triton kernel: PyTorch's CPU compiler emits C++, Liger's kernels are
refused on CPU (`--use_liger_kernel`), and vLLM's CPU build turns Triton off itself. The import still maps
`libtriton.so` and about 70 modules: measured 71 MB of PSS per process (torch 2.13.0+cpu, triton 3.9.0, the 2-core
CI machine), in each actor, engine and trainer process.

`hide_triton_without_gpu_backend()` marks `triton` as absent (`sys.modules["triton"] = None`, Python's own way of
blocking an import) when this PyTorch has no GPU backend and nothing has imported Triton yet. `import triton` then
raises ModuleNotFoundError and `importlib.util.find_spec("triton")` returns None, which is how PyTorch, Transformers
and vLLM ask whether Triton is there. `RLHFKIT_KEEP_TRITON=1` leaves it alone (for Triton's own CPU backend,
triton-cpu). rlhfkit's model loading and its vLLM engine call it before they import Transformers' models or vLLM.
"""

from __future__ import annotations

import os
import sys

KEEP_ENV = "RLHFKIT_KEEP_TRITON"


def torch_has_gpu_backend() -> bool:
    """Whether this PyTorch was built for CUDA, ROCm or XPU (a build fact: no device needs to be present)."""
    import torch

    version = torch.version
    return any(getattr(version, name, None) for name in ("cuda", "hip", "xpu"))


def hide_triton_without_gpu_backend() -> bool:
    """Mark `triton` as not installed in this process when PyTorch cannot use it; True when it did so (or had)."""
    if os.environ.get(KEEP_ENV, "") == "1":
        return False
    if "triton" in sys.modules:  # imported already (or hidden by an earlier call): too late to change, or done
        return sys.modules["triton"] is None
    if torch_has_gpu_backend():
        return False
    sys.modules["triton"] = None  # type: ignore[assignment]
    return True
