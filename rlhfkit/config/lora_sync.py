"""`--lora_sync`: what a weight sync of a LoRA policy sends the rollout engines, decided once from the flags.

- `adapter`: the LoRA adapter only, into an adapter slot each engine keeps over its unchanged base model (the
  Transformers engine: PEFT LoRA layers; vLLM: its LoRA support, `enable_lora` with one slot);
- `merged`: the adapter merged into full weights, the whole model at every sync (OpenRLHF's way);
- `full`: no LoRA (`--lora_rank 0`): the full weights, as always.
`auto` picks adapter where the engine can hold the adapter: the Transformers engine always, vLLM when it offers a
slot of the rank (`VLLM_LORA_RANKS`, up to 512); otherwise merged, with one line saying why.
"""

from __future__ import annotations

from rlhfkit.config.specs import VLLM_LORA_RANKS
from rlhfkit.errors import UserError


def adapter_unsupported(lora_rank: int, backend: str) -> str | None:
    """Why the `backend` engine cannot hold an adapter of `lora_rank` (None: it can)."""
    if backend == "vllm" and lora_rank > VLLM_LORA_RANKS[-1]:
        return f"vLLM's LoRA slots go up to rank {VLLM_LORA_RANKS[-1]} (--lora_rank {lora_rank})"
    return None


def lora_sync_mode(flag: str, lora_rank: int, backend: str) -> tuple[str, str | None]:
    """(mode: adapter, merged or full; a line to print once at start, or None). UserError when `--lora_sync
    adapter` asks for what the engine cannot hold."""
    if lora_rank <= 0:
        return "full", None
    why = adapter_unsupported(lora_rank, backend)
    if flag == "merged":
        return "merged", None
    if why is None:
        return "adapter", None
    if flag == "adapter":
        raise UserError(f"--lora_sync adapter: {why}; use --lora_sync merged (or auto)")
    return "merged", f"--lora_sync auto: weights sync merged, not adapter-only: {why}"
