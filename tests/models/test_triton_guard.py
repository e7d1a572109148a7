"""rlhfkit.models.triton_guard: Triton stays out of a process whose PyTorch has no GPU backend, and nothing that
asks for it breaks."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from rlhfkit.models import triton_guard

ROOT = Path(__file__).resolve().parents[2]
CPU_TORCH = not triton_guard.torch_has_gpu_backend()
TRITON_INSTALLED = importlib.util.find_spec("triton") is not None or sys.modules.get("triton") is not None


def run_fresh(code: str, **env: str) -> dict:
    """Run `code` in a new interpreter (this process may hold Triton already); it prints one JSON line."""
    full_env = {k: v for k, v in os.environ.items() if k != triton_guard.KEEP_ENV}
    full_env.update(PYTHONPATH=str(ROOT), **env)
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=180,
                         env=full_env, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


LOAD_AND_TRAIN = """
    import importlib.util, json, sys
    import torch
    import rlhfkit.models.loading  # the guard runs when model loading is imported
    from transformers import LlamaConfig, LlamaForCausalLM  # imports torch._dynamo, which asks for Triton
    import torch._dynamo
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2))
    ids = torch.randint(0, 64, (2, 8))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    try:
        import triton
        blocked = False
    except ModuleNotFoundError:
        blocked = True
    print(json.dumps({"hidden": sys.modules.get("triton", 1) is None, "import_blocked": blocked,
                      "find_spec_none": importlib.util.find_spec("triton") is None,
                      "dynamo_sees_triton": torch.utils._triton.has_triton_package(),
                      "loss_finite": bool(torch.isfinite(loss)),
                      "triton_modules": sum(1 for m in sys.modules if m.startswith("triton."))}))
"""


@pytest.mark.skipif(not CPU_TORCH, reason="a PyTorch with a GPU backend keeps Triton")
def test_a_process_that_loads_models_never_imports_triton_and_still_trains() -> None:
    r = run_fresh(LOAD_AND_TRAIN)
    assert r == {"hidden": True, "import_blocked": True, "find_spec_none": True, "dynamo_sees_triton": False,
                 "loss_finite": True, "triton_modules": 0}


@pytest.mark.skipif(not (CPU_TORCH and TRITON_INSTALLED), reason="needs Triton installed next to a CPU PyTorch")
def test_keep_triton_env_leaves_it_importable() -> None:
    r = run_fresh(LOAD_AND_TRAIN, RLHFKIT_KEEP_TRITON="1")
    assert r["hidden"] is False and r["import_blocked"] is False and r["dynamo_sees_triton"] is True
    assert r["loss_finite"] and r["triton_modules"] > 0


def test_guard_hides_only_without_a_gpu_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(triton_guard.KEEP_ENV, raising=False)
    monkeypatch.delitem(sys.modules, "triton", raising=False)  # restored after the test, whatever it held
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    assert triton_guard.torch_has_gpu_backend()
    assert triton_guard.hide_triton_without_gpu_backend() is False and "triton" not in sys.modules
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", "6.4")
    assert triton_guard.hide_triton_without_gpu_backend() is False and "triton" not in sys.modules
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.version, "xpu", None, raising=False)
    assert not triton_guard.torch_has_gpu_backend()
    assert triton_guard.hide_triton_without_gpu_backend() is True and sys.modules["triton"] is None
    assert triton_guard.hide_triton_without_gpu_backend() is True  # a second call: already hidden
    with pytest.raises(ModuleNotFoundError):
        import triton  # noqa: F401
    assert importlib.util.find_spec("triton") is None


def test_guard_leaves_an_imported_triton_and_honours_keep(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.version, "xpu", None, raising=False)
    loaded = object()
    monkeypatch.setitem(sys.modules, "triton", loaded)  # someone imported it first: too late, and left as it is
    assert triton_guard.hide_triton_without_gpu_backend() is False and sys.modules["triton"] is loaded
    monkeypatch.delitem(sys.modules, "triton")
    monkeypatch.setenv(triton_guard.KEEP_ENV, "1")
    assert triton_guard.hide_triton_without_gpu_backend() is False and "triton" not in sys.modules
