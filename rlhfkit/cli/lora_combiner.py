"""`python -m rlhfkit.cli.lora_combiner --model_path BASE --lora_path ADAPTER --output_path OUT [--is_rm]`: merge a
LoRA adapter into its base model and save a plain Hugging Face model (loads without PEFT), with the base's tokenizer.

For a reward model or critic (`--is_rm`) the value head saved with the adapter replaces the base model's head.
Reward statistics (`reward_mean` / `reward_std`, written by train_rm into the merged model's config) are not part
of an adapter; the merged model loads without them.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from rlhfkit.cli.common import quiet_libraries, run_cli
from rlhfkit.config.base import parse_config, required
from rlhfkit.config.lora_combiner import LoraCombinerConfig

PROG = "rlhfkit.cli.lora_combiner"


def main(argv: Sequence[str] | None = None) -> int:
    quiet_libraries()
    cfg = parse_config(LoraCombinerConfig, argv, PROG, __doc__)
    cfg.check_inputs()
    import torch

    from rlhfkit.models.loading import load_tokenizer
    from rlhfkit.models.lora import merge_adapter
    from rlhfkit.models.publish import publish_model_dir, staging_dir

    dtype = torch.bfloat16 if cfg.bf16 else torch.float32
    model_path, output_path = required(cfg.model_path, "model_path"), required(cfg.output_path, "output_path")
    model = merge_adapter(model_path, required(cfg.lora_path, "lora_path"), is_rm=cfg.is_rm,
                          value_head_prefix=cfg.value_head_prefix, dtype=dtype)
    tokenizer = load_tokenizer(model_path, flag="--model_path")
    staging = staging_dir(output_path)  # written aside, moved in config.json last: a kill leaves no half model
    model.save_pretrained(str(staging), safe_serialization=True)
    tokenizer.save_pretrained(str(staging))
    publish_model_dir(staging, output_path)
    kind = "reward model" if cfg.is_rm else "model"
    print(f"lora_combiner: merged {cfg.lora_path} into {cfg.model_path}; {kind} saved to {cfg.output_path}")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main, prog=PROG))
