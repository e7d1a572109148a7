"""Config of `rlhfkit.cli.lora_combiner` (OpenRLHF's lora_combiner flags)."""

from __future__ import annotations

from dataclasses import dataclass

from rlhfkit.config.base import arg
from rlhfkit.config.paths import check_output_paths
from rlhfkit.errors import UserError


@dataclass
class LoraCombinerConfig:
    model_path: str | None = arg(None, "Base model directory the adapter was trained on.")
    lora_path: str | None = arg(None, "LoRA adapter directory (adapter_config.json + adapter weights; trainers "
                                      "run with --lora_rank write one to <save_path>/lora_adapter).")
    output_path: str | None = arg(None, "Where the merged model and the base model's tokenizer are saved (written "
                                        "beside it, then moved in; never --model_path or --lora_path, nor inside "
                                        "them).")
    is_rm: bool = arg(False, "The adapter belongs to a reward model or critic (a value head on the backbone, saved "
                             "in full with the adapter).")
    value_head_prefix: str = arg("score", "Attribute name of the reward model's linear head (--is_rm).")
    bf16: bool = arg(False, "Merge and save in bfloat16 (default: float32).")

    def validate(self) -> None:
        """Every flag rule (UserError, one line); the directories themselves are checked when read."""
        for flag in ("model_path", "lora_path", "output_path"):
            if not getattr(self, flag):
                raise UserError(f"--{flag} is required")

    def check_inputs(self) -> None:
        """The output is a new directory, not the base model or the adapter (nor inside them), before any merge."""
        check_output_paths(self, {"output_path": "dir"})
