"""The GPU suite's arithmetic and report without running anything: PaLM's model FLOPs, the MFU and ratio cells, and
that a failed, skipped or missing stage shows up in the report instead of breaking it."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "bench"), str(ROOT / "bench" / "gpu")]

import flops  # noqa: E402
import report  # noqa: E402
import suite  # noqa: E402


def test_train_flops_is_palm_formula():
    shape = flops.ModelShape(matmul_params=1000, layers=2, attn_width=8)
    # per sequence of T tokens: 6 N T + 12 L d T^2
    assert flops.train_flops(shape, [10, 20]) == 6 * 1000 * 30 + 12 * 2 * 8 * (100 + 400)
    assert flops.forward_flops(shape, [10]) == flops.train_flops(shape, [10]) / 3


def test_model_shape_counts_a_tied_embedding_once(tmp_path):
    from transformers import Qwen2Config

    for tied in (True, False):
        config = Qwen2Config(vocab_size=100, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
        config.save_pretrained(tmp_path / str(tied))
    tied, untied = (flops.model_shape(tmp_path / name) for name in ("True", "False"))
    assert tied.layers == 2 and tied.attn_width == 16
    # untied: the LM head is a second 100 x 16 matrix, the input embedding (a lookup) is left out of both
    assert untied.matmul_params == tied.matmul_params


def test_report_shows_ratios_mfu_errors_and_skips():
    sizes = suite.SMOKE
    work = {"units": {"sft": 1000.0, "dpo": 2, "grpo": 1}, "flops": {"sft": 4e12, "dpo": 2e12}, "matmul_params": 1e6}
    results = {"peak": {"tflops": 100.0, "shape": "8192^3", "dtype": "bfloat16"},
               "checks": {"bf16_vs_fp32": {"passed": True, "max_rel_diff": 0.01},
                          "engine_logprobs": {"passed": False, "error": "RuntimeError: boom"}},
               "rlhfkit": [{"sft": [0.1, 0.1], "sft_peak_gib": 12.0, "dpo_error": "OutOfMemoryError: x",
                            "grpo": [2.0], "grpo_extra": {"response_length": 256.0}}],
               "trl": [{"sft": [0.2], "sft_peak_gib": 14.0, "dpo": [0.5], "grpo": [4.0]}],
               "notes": ["trl-2 not run: 10 s of the budget left"], "stages": {"checks": 30.0}}
    text = "\n".join(report.report(results, sizes, work, "header"))
    # SFT: 1000 tokens / 0.1 s; step-time ratio 0.5; MFU 4e12 / 0.1 s / 100e12 = 40%
    assert "| sft | tokens/s | 1e+04 | 5e+03 | **0.50** | 0.100 | 0.200 | 40.0% | 20.0% | 12.0 | 14.0 | 2, 1 |" in text
    assert "| dpo | pairs/s | failed | 4 | n/a |" in text
    assert "| grpo | s/step | 2 | 4 | **0.50** |" in text
    assert "| engine_logprobs | **no** |" in text and "**OutOfMemoryError: x**" in text
    assert "trl-2 not run" in text and "mean response length 256.0" in text
    assert "TRL was not run" not in text
