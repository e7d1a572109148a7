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


def test_sdpa_on_a_gpu_runs_without_the_cudnn_kernel(monkeypatch):
    """bench/results/gpu.md: cuDNN attention re-plans every new batch shape; rlhfkit turns it off where it loads an
    SDPA model on CUDA, and leaves it alone on CPU and for other kernels."""
    from rlhfkit.models.loading import avoid_cudnn_attention

    before = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        torch.backends.cuda.enable_cudnn_sdp(True)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        avoid_cudnn_attention("sdpa")
        assert torch.backends.cuda.cudnn_sdp_enabled()  # CPU: untouched
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        avoid_cudnn_attention("eager")
        avoid_cudnn_attention("flash_attention_2")
        assert torch.backends.cuda.cudnn_sdp_enabled()
        avoid_cudnn_attention("sdpa")
        assert not torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)
