"""`--full_determinism`: two runs with the same seed, flags and layout give bit-identical weights.

What the seed alone already fixes (every run): python, numpy and torch's generators (`strategy.set_seed`, in every
training process, Ray workers included), the data order (generators seeded by (seed, epoch)), the replay buffer's
shuffles (seed, step), and rollout sampling (engine i / prompt j of step k samples with its own derived seed).

What the flag adds, in each training process (`enable_full_determinism`, from `DeepSpeedStrategy.setup_distributed`)
and each Ray role worker and engine (the `FLAG_ENV` variable reaches them through `worker_env`):
- `torch.use_deterministic_algorithms(True)`: an op without a deterministic kernel stops the run instead of
  silently adding in a varying order (most such kernels are CUDA ones: index_add, scatter_add, embedding backward);
  cuDNN's deterministic mode and no autotuning; `CUBLAS_WORKSPACE_CONFIG=:4096:8` (cuBLAS needs it for
  deterministic GEMMs from CUDA 10.2 on); oneDNN's deterministic mode on CPU.
- One intra-op thread on CPU (`torch.set_num_threads(1)` and OMP/MKL_NUM_THREADS=1 for the Ray processes): a
  reduction split over N threads adds its partial sums in an order that depends on N (a sum of 4M numbers differs
  in its last bits between one and two threads), and a run diverges from the first such difference. One thread is
  the fixed order: the results depend only on the torch build and the CPU, not on the machine's thread count.
  (The SFT runs measured for docs/troubleshooting.md gave the same weights at one and two threads without the
  flag: torch's CPU matmuls split the output, not the summed dimension; the flag makes it a guarantee.) It costs
  speed: leave the flag off for throughput.
- PYTHONHASHSEED=0 for the Ray processes (set iteration order in user reward code).

What it cannot fix on GPU (`GPU_LIMITS`, printed once when a GPU is present): see the list below.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

#: Set (to "1") in the driver when --full_determinism is on; Ray role workers and engines read it at start.
FLAG_ENV = "RLHFKIT_FULL_DETERMINISM"

#: The parts of a run that stay non-deterministic on GPU even with --full_determinism.
GPU_LIMITS = (
    "vLLM's continuous batching: which requests share a forward depends on timing, and batched GPU kernels round "
    "differently per batch shape, so sampled tokens and their log-probs can differ between runs",
    "NCCL all-reduce: the reduction order follows the ring/tree NCCL picks for the topology and message size "
    "(fixed only with NCCL_ALGO/NCCL_PROTO pinned and the same GPUs and links)",
    "flash-attention's backward pass accumulates dK/dV with atomic adds (use --attn_implementation eager or sdpa "
    "with the math kernel for a deterministic backward)",
    "Triton and torch.compile / deepcompile kernels autotuned per run, and Liger kernels built on them",
    "DeepSpeed ZeRO's bucketed, overlapped gradient reduction (--overlap_comm) when buckets fill in varying order",
)


def gpu_limits_note() -> str:
    """One startup line (with its list) naming what --full_determinism cannot make deterministic on GPU."""
    return ("--full_determinism on GPU: these parts cannot be made deterministic, so two runs can still differ: "
            + "; ".join(f"({i}) {item}" for i, item in enumerate(GPU_LIMITS, 1)))


def determinism_env() -> dict[str, str]:
    """Environment of a Ray process under --full_determinism: one thread, a fixed hash seed, cuBLAS's workspace."""
    return {FLAG_ENV: "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONHASHSEED": "0",
            "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}


def flag_from_env() -> bool:
    """True in a process started by a --full_determinism run (a Ray role worker or engine)."""
    return os.environ.get(FLAG_ENV) == "1"


def enable_full_determinism() -> None:
    """Switch this process to deterministic algorithms and one intra-op thread (see the module docstring).
    Idempotent; the caller seeds the generators."""
    os.environ[FLAG_ENV] = "1"
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read by cuBLAS when its handle is created
    torch.use_deterministic_algorithms(True, warn_only=False)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    # torch's stubs type this module-level switch as its descriptor (ContextProp); assigning a bool is its API
    torch.backends.mkldnn.deterministic = True  # type: ignore[assignment]
    if not torch.cuda.is_available():
        torch.set_num_threads(1)


_noted = False


def note_gpu_limits(print_fn: Callable[[str], object] = print) -> bool:
    """Print `gpu_limits_note()` once per process when a CUDA GPU is present; True when it was printed now."""
    global _noted
    if _noted or not torch.cuda.is_available():
        return False
    _noted = True
    print_fn(gpu_limits_note())
    return True
