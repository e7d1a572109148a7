"""Fixtures of the demo tests. `demo_assets` (one build per session) comes from tests/conftest.py."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def demo_tokenizer(demo_assets):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(demo_assets.model_dir)


@pytest.fixture(scope="session")
def demo_model(demo_assets):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(demo_assets.model_dir)
