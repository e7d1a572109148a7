"""Defaults that depend on the machine: `--bf16` and `--attn_implementation auto`, resolved once, when a command's
flags are parsed (`rlhfkit.config.base.parse_config`).

OpenRLHF 0.11 trains in bf16 with flash_attention_2 unless told otherwise; neither exists on a CPU. rlhfkit's
default is "auto" for both: bf16 when a CUDA GPU is visible to the process that parses the flags, fp32 otherwise;
flash_attention_2 when, besides the GPU, the flash-attn package is importable, sdpa otherwise. A value given on the
command line or in a `--config` file is used as given (`--param_dtype fp32` or `--attn_implementation sdpa` on a
GPU). `--bf16` keeps its type (a bool, False in the dataclass): not given, `resolve_device_defaults` sets it. A
config built in code without `parse_config` trains in fp32 unless it sets bf16, and its "auto" kernel is resolved
where the kernel is chosen (`rlhfkit.models.loading.resolve_attn_implementation`).
"""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import Any

from rlhfkit.errors import UserError

AUTO = "auto"
ATTN_CHOICES = (AUTO, "sdpa", "eager", "flash_attention_2")
ATTN_HELP = ("Attention kernel. auto (the default): flash_attention_2 on a CUDA GPU when the flash-attn package is "
             "installed (OpenRLHF's default), else sdpa.")
BF16_HELP = ("Train and run the model in bfloat16 (fp32 master weights in the optimizer). Not given: bf16 on a "
             "CUDA GPU (OpenRLHF's default), fp32 on CPU; --param_dtype fp32 keeps fp32 on a GPU.")


def cuda_available() -> bool:
    """A CUDA device is visible here (torch is imported only now: --help and flag errors answer without it)."""
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return bool(torch.cuda.is_available())


def check_gpu_only(flag: str, why: str, package: str | None = None) -> None:
    """The rule of the GPU-only kernel flags (--use_liger_kernel, --deepcompile), checked when the flags are parsed:
    a UserError naming what is missing here (a CUDA GPU; the `package`, when one is needed), with `why`."""
    missing = [] if cuda_available() else ["a CUDA GPU"]
    if package is not None and importlib.util.find_spec(package) is None:
        missing.append(f"the {package} package")
    if missing:
        raise UserError(f"--{flag} needs {' and '.join(missing)} ({why}), missing here; drop --{flag}")


def auto_bf16() -> bool:
    return cuda_available()


def flash_attn_installed() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def auto_attn_implementation() -> str:
    if cuda_available() and flash_attn_installed():
        return "flash_attention_2"
    return "sdpa"


def resolve_device_defaults(cfg: Any, given: frozenset[str]) -> None:
    """Set every "auto" attention kernel of `cfg` and its sections, and `bf16` unless the command gave it (`given`:
    the fields set by a flag or the config file), to this machine's choice."""
    for section in _sections(cfg):
        if getattr(section, "attn_implementation", None) == AUTO:
            section.attn_implementation = auto_attn_implementation()
        if hasattr(section, "bf16") and "bf16" not in given:
            section.bf16 = auto_bf16()


def _sections(cfg: Any) -> list[Any]:
    found = [cfg]
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            found += _sections(value)
    return found
