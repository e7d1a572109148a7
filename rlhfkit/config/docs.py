"""Write the flag tables of the README from the config dataclasses: `python -m rlhfkit.config.docs README.md`.

Each table lives between `<!-- flags:NAME -->` and `<!-- /flags:NAME -->` markers, so the README's prose stays
hand-written while the tables cannot drift from the code (a test checks they are current).
"""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

from rlhfkit.config.base import flag_table

# marker name -> "module:Class" of the config it documents (only those that exist are rendered)
TABLES = {
    "train_sft": "rlhfkit.config.sft:SFTConfig",
    "train_rm": "rlhfkit.config.preference:RMConfig",
    "train_dpo": "rlhfkit.config.preference:DPOConfig",
    "train_kto": "rlhfkit.config.preference:KTOConfig",
    "train_ppo": "rlhfkit.config.rl:PPOConfig",
    "batch_inference": "rlhfkit.config.batch_inference:BatchInferenceConfig",
    "lora_combiner": "rlhfkit.config.lora_combiner:LoraCombinerConfig",
    "interactive_chat": "rlhfkit.config.chat:ChatConfig",
}


def load_config_class(spec: str) -> type | None:
    module, _, name = spec.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None


def render(text: str) -> str:
    """`text` with every marked table replaced by the current flags."""
    for marker, spec in TABLES.items():
        cls = load_config_class(spec)
        pattern = re.compile(rf"(<!-- flags:{marker} -->\n).*?(<!-- /flags:{marker} -->)", re.S)
        if cls is not None and pattern.search(text):
            table = flag_table(cls)
            text = pattern.sub(lambda m, t=table: m.group(1) + t + "\n" + m.group(2), text)
    return text


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    path = Path(args[0] if args else "README.md")
    path.write_text(render(path.read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
