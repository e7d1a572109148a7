"""Synthetic config.json files of public model shapes for planner tests (no weights exist offline)."""

from __future__ import annotations

import json
from pathlib import Path

# Llama-2's published configs (meta-llama/Llama-2-7b-hf and -70b-hf config.json), the fields the planner reads.
LLAMA2_7B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32000, "hidden_size": 4096,
             "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
             "num_key_value_heads": 32, "max_position_embeddings": 4096, "tie_word_embeddings": False}
LLAMA2_70B = {**LLAMA2_7B, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
              "num_attention_heads": 64, "num_key_value_heads": 8}


def write_config(directory: Path, config: dict) -> Path:
    """A model directory holding only config.json."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config), encoding="utf-8")
    return directory
