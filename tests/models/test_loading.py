"""--load_in_4bit (QLoRA) refuses what it cannot do with one line naming the missing piece."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from rlhfkit.errors import UserError
from rlhfkit.models.loading import quantization_config


def test_not_asked_is_none():
    assert quantization_config(False, 0, False) is None


def test_needs_lora():
    with pytest.raises(UserError, match="--lora_rank"):
        quantization_config(True, 0, True)


@pytest.mark.skipif(torch.cuda.is_available() and importlib.util.find_spec("bitsandbytes") is not None,
                    reason="this machine can run QLoRA")
def test_names_what_is_missing_here():
    with pytest.raises(UserError) as e:
        quantization_config(True, 8, True)
    message = str(e.value)
    assert ("a CUDA GPU" in message) == (not torch.cuda.is_available())
    assert ("bitsandbytes package" in message) == (importlib.util.find_spec("bitsandbytes") is None)
    assert "drop --load_in_4bit" in message and "\n" not in message
