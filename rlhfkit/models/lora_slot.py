"""The LoRA adapter as it travels from the trainer to a rollout engine (adapter-only weight sync, `--lora_sync`).

The trainer's PEFT model names an adapter weight `base_model.model.<module>.lora_A.<adapter>.weight`; the wire and
PEFT's checkpoint files (`adapter_model.safetensors`, which vLLM reads) drop the adapter name:
`base_model.model.<module>.lora_A.weight`. An engine holds the frozen base model plus one adapter *slot*: the
Transformers engine injects PEFT LoRA layers into its plain model once (`inject_adapter_slot`) and copies each sync's
tensors into them in place (`load_adapter_tensors`); vLLM loads the same names from a directory
(`write_adapter_dir`).

Only the low-rank matrices move, r x (in + out) numbers per adapted matrix instead of in x out (Hu et al. 2021,
"LoRA: Low-Rank Adaptation of Large Language Models"), so a sync moves the adapter's size, not the model's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

PEFT_PREFIX = "base_model.model."
ADAPTER = "default"  # the adapter name PEFT gives the one adapter of a model, and the engine slot's name


def is_adapter_parameter(name: str) -> bool:
    """Whether a PEFT model parameter belongs to a LoRA adapter (not the frozen base)."""
    return ".lora_A." in name or ".lora_B." in name or ".lora_embedding_" in name


def wire_name(param_name: str, adapter: str = ADAPTER) -> str:
    """`...q_proj.lora_A.default.weight` -> `...q_proj.lora_A.weight` (PEFT's checkpoint spelling)."""
    return param_name.replace(f".{adapter}.", ".").replace(f".{adapter}", "")


def slot_name(wire: str, adapter: str = ADAPTER) -> str:
    """A wire name as the parameter of a plain Transformers model with the adapter injected: the PEFT wrapper prefix
    dropped, the adapter name put back (`model.layers.0.self_attn.q_proj.lora_A.default.weight`)."""
    name = wire.removeprefix(PEFT_PREFIX)
    for part in ("lora_A", "lora_B"):
        name = name.replace(f".{part}.weight", f".{part}.{adapter}.weight")
    for part in ("lora_embedding_A", "lora_embedding_B"):
        name = name.replace(f".{part}", f".{part}.{adapter}")
    return name


def adapter_config(model: Any, adapter: str = ADAPTER) -> dict[str, Any]:
    """The PEFT LoRA config of `model`'s adapter as a JSON-ready dict (target modules resolved to a sorted list), what
    `adapter_config.json` holds."""
    config = model.peft_config[adapter].to_dict()
    for key, value in config.items():
        if isinstance(value, set):
            config[key] = sorted(value)
    config["inference_mode"] = True
    return config


def payload_bytes(tensors: dict[str, torch.Tensor]) -> int:
    """Bytes of the adapter's tensors: the adapter's size (what PEFT's safetensors file holds, less its header)."""
    return sum(t.numel() * t.element_size() for t in tensors.values())


def pack(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[tuple[str, str, list[int]]]]:
    """The adapter as one flat buffer per dtype plus an index of (name, dtype, shape), in order: what travels. One
    buffer instead of a tensor per matrix keeps the transport's per-object overhead (pickled tensor headers, buffer
    alignment) off the bytes moved, whatever the number of adapted matrices."""
    groups: dict[str, list[torch.Tensor]] = {}
    index = []
    for name, t in tensors.items():
        dtype = str(t.dtype).removeprefix("torch.")
        groups.setdefault(dtype, []).append(t.reshape(-1))
        index.append((name, dtype, list(t.shape)))
    return {dtype: torch.cat(parts) for dtype, parts in groups.items()}, index


def unpack(flat: dict[str, torch.Tensor], index: list[tuple[str, str, list[int]]]) -> dict[str, torch.Tensor]:
    """`pack`'s inverse: views into the flat buffers under their names and shapes."""
    offsets = dict.fromkeys(flat, 0)
    out = {}
    for name, dtype, shape in index:
        n = int(torch.Size(shape).numel())
        out[name] = flat[dtype][offsets[dtype]:offsets[dtype] + n].view(shape)
        offsets[dtype] += n
    return out


def inject_adapter_slot(model: nn.Module, config: dict[str, Any]) -> nn.Module:
    """Put an (untrained) LoRA adapter named `ADAPTER` into the plain Transformers `model`, in place; dropout off."""
    from peft import LoraConfig, inject_adapter_in_model

    fields = {k: v for k, v in config.items() if k in LoraConfig.__dataclass_fields__}
    fields.update(lora_dropout=0.0, inference_mode=True)
    return inject_adapter_in_model(LoraConfig(**fields), model, adapter_name=ADAPTER)


@torch.no_grad()
def load_adapter_tensors(model: nn.Module, tensors: dict[str, torch.Tensor]) -> int:
    """Copy wire-named adapter tensors into the slot of `model` (see `inject_adapter_slot`); every adapter parameter
    of the slot must come. Returns how many were loaded."""
    own = {name: p for name, p in model.named_parameters() if is_adapter_parameter(name)}
    incoming = {slot_name(name): t for name, t in tensors.items()}
    unknown, missing = sorted(set(incoming) - set(own)), sorted(set(own) - set(incoming))
    if unknown or missing:
        raise ValueError(f"the adapter does not fit the engine's slot: unknown {unknown[:3]}, missing {missing[:3]}")
    for name, tensor in incoming.items():
        own[name].copy_(tensor.to(device=own[name].device, dtype=own[name].dtype))
    return len(incoming)


def write_adapter_dir(path: str | Path, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Path:
    """A PEFT adapter directory (`adapter_config.json`, `adapter_model.safetensors`) that vLLM's LoRA loader reads."""
    from safetensors.torch import save_file

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    (out / "adapter_config.json").write_text(json.dumps(config))
    # clone: unpacked tensors are views of one buffer, which safetensors refuses to save as separate tensors
    save_file({name: t.clone() for name, t in tensors.items()}, str(out / "adapter_model.safetensors"))
    return out
