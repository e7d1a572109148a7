"""Offline demo assets: a trained-on-the-spot tokenizer, a random-init tiny Llama and verifiable toy tasks.

`build_demo_assets(out_dir)` writes everything the demo and the tests need without network access. Importing
this package is cheap: the torch/transformers parts load on first use (a reward function only needs `tasks`).
"""

from __future__ import annotations

import importlib
from typing import Any

from rlhfkit.demo.tasks import DEMO_INPUT_TEMPLATE, extract_answer, is_correct, make_problem

_LAZY = {
    "build_demo_assets": "rlhfkit.demo.assets",
    "DemoAssets": "rlhfkit.demo.assets",
    "build_tokenizer": "rlhfkit.demo.tokenizer",
    "exact_match": "rlhfkit.demo.evaluate",
    "evaluate_exact_match": "rlhfkit.demo.evaluate",
}

__all__ = ["DEMO_INPUT_TEMPLATE", "extract_answer", "is_correct", "make_problem", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'rlhfkit.demo' has no attribute {name!r}")
