"""bench/machine_limit.py's arithmetic against hand computations: the matmul parameters of one model shape, the
FLOPs of a training step and of a shared prompt, and a fraction of the limit in the bench table."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "bench")]

import common  # noqa: E402
import machine_limit  # noqa: E402

# the demo model's shape (rlhfkit.demo.assets.tiny_llama_config) with a 1,000-token vocabulary
TINY = {"hidden_size": 128, "intermediate_size": 344, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 1000}


def test_tiny_shape_and_train_flops_by_hand():
    # per layer: q 128x128, k and v 128x64 (2 KV heads of 32), o 128x128, gate and up 128x344, down 344x128
    per_layer = 128 * 128 + 2 * 128 * 64 + 128 * 128 + 3 * 128 * 344
    assert per_layer == 181_248
    n = 4 * per_layer + 128 * 1000  # plus the LM head (the input embedding is a lookup)
    shape = machine_limit.model_shape(TINY)
    assert (shape.matmul_params, shape.layers, shape.attn_width) == (n, 4, 128)
    # two rows of 10 and 20 tokens: 6 N per token, 12 L d_attn T^2 per row
    assert machine_limit.train_flops(shape, [10, 20]) == 6 * 852_992 * 30 + 12 * 4 * 128 * (100 + 400)


def test_shared_prompt_counts_once():
    shape = machine_limit.model_shape(TINY)
    one = machine_limit.shared_prefix_flops(shape, 7, [5], train=True)
    assert one == machine_limit.train_flops(shape, [12])
    assert machine_limit.shared_prefix_flops(shape, 7, [5], train=False) == one / 3
    # a pair: the prompt's 7 tokens once, its 7x7 attention block once, each answer against prompt and itself
    pair = machine_limit.shared_prefix_flops(shape, 7, [5, 3], train=True)
    assert pair == 6 * shape.matmul_params * 15 + 12 * 4 * 128 * (49 + (2 * 7 * 5 + 25) + (2 * 7 * 3 + 9))


def test_rates_and_the_table_cell():
    rates = machine_limit.model_rates(TINY, tokens=8, threads=1, seconds=0.001)
    assert rates["train"] > 0 and rates["forward"] > 0 and set(rates["per_shape"]) >= {"q", "down", "lm_head"}
    assert set(rates["kernels"]) == set(machine_limit.fp32_kernels())  # every fp32 kernel measured, the best taken
    assert rates["train"] >= max(r["train"] for r in rates["kernels"].values()) * 0.999
    run = {"times": [2.0, 2.0], "cpu": [2.0], "runs": [2.0], "rss": [1.0], "extra": {}}
    results = {"case": {"rlhfkit": run, "trl": {**run, "times": [4.0], "runs": [4.0]}}}
    lines = common.table(results, floor=lambda case, system, extra: 1.0)
    assert "% of machine limit" in lines[0] and lines[1].count("---") == 13
    assert "| **0.50** | 50% (CPU 50%) | 25% (CPU 50%) |" in lines[2]


def test_machine_rate_takes_each_shape_on_its_faster_kernel_by_hand():
    # two shapes at 10 tokens: "a" 2x3 (2 layers), "b" 3x4 (1 layer); FLOPs of a forward 2*10*(6*2 + 12) = 480
    shapes = [("a", 2, 3, 2), ("b", 3, 4, 1)]
    times = {"aten": {(2, 3): (1.0, 3.0), (3, 4): (2.0, 6.0)}, "onednn": {(2, 3): (0.5, 4.0), (3, 4): (1.0, 2.0)}}
    r = machine_limit.rates_from_times(shapes, 10, times)
    assert r["kernels"]["aten"]["forward"] == 480 / (1.0 * 2 + 2.0)
    assert r["kernels"]["aten"]["train"] == 3 * 480 / (3.0 * 2 + 6.0)
    assert r["kernels"]["onednn"]["train"] == 3 * 480 / (4.0 * 2 + 2.0)
    # the machine: forward on the faster forward (onednn both), training "a" on aten (3 < 4) and "b" on onednn
    assert r["forward"] == 480 / (0.5 * 2 + 1.0)
    assert r["train"] == 3 * 480 / (3.0 * 2 + 2.0)
    assert r["kernel_of"] == {"a": "aten", "b": "onednn"}
    assert r["per_shape"] == {"a": 6 * 10 * 6 / 3.0, "b": 6 * 10 * 12 / 2.0}
    assert "aten 120, onednn 144" == machine_limit.kernel_cells(
        {"kernels": {"aten": {"train": 120e9}, "onednn": {"train": 144e9}}})
