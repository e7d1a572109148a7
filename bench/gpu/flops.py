"""Model FLOPs and the device's own measured matmul peak, for MFU (model FLOPs utilisation).

MFU as defined in PaLM (Chowdhery et al. 2022, "PaLM: Scaling Language Modeling with Pathways", Appendix B): the
FLOPs a step needs by the model's arithmetic, whatever the implementation skips or recomputes, divided by the step
time and by the peak rate. A token of a sequence of length T costs 6N for the forward and backward matmuls over the
N parameters that take part in matmuls, plus 12 * L * d_attn * T for attention scores and values (L layers,
d_attn = heads x head size); a forward alone costs a third of that. The peak is not the data sheet's: it is what the
same device gives a large bf16 matmul in this run (on an H100 about 790 TFLOP/s, against 989 on paper), so the
fraction says how far the step is from what this chip does in practice.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path


@dataclass
class ModelShape:
    matmul_params: int  # parameters multiplied per token (the input embedding is a lookup, not a matmul)
    layers: int
    attn_width: int  # heads x head size


def model_shape(model_dir: Path) -> ModelShape:
    """The shape of a Hugging Face causal LM, built on the meta device (no memory, no time)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    total = sum(p.numel() for p in model.parameters())  # a tied embedding is counted once: as the LM head
    embedding = model.get_input_embeddings().weight.numel()
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return ModelShape(total - (0 if tied else embedding), config.num_hidden_layers,
                      config.num_attention_heads * head_dim)


def train_flops(shape: ModelShape, lengths: list[int]) -> float:
    """Forward and backward over sequences of these lengths (PaLM's 6N + 12 L d_attn T per token)."""
    return float(sum(6 * shape.matmul_params * t + 12 * shape.layers * shape.attn_width * t * t for t in lengths))


def forward_flops(shape: ModelShape, lengths: list[int]) -> float:
    """A forward alone (a frozen reference model): a third of `train_flops`."""
    return train_flops(shape, lengths) / 3


def matmul_peak(seconds: float = 3.0) -> dict:
    """TFLOP/s of a square matmul on this device: 8192^3 in bf16 on a GPU (the dense-math ceiling of the chip as
    measured, three warm-ups, then as many products as fit in `seconds`), 512^3 in fp32 on a CPU (the smoke run:
    same code path, a number of no meaning)."""
    import torch

    cuda = torch.cuda.is_available()
    n, dtype, device = (8192, torch.bfloat16, "cuda") if cuda else (512, torch.float32, "cpu")
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(3):
        a @ b
    sync()
    start, count = time.perf_counter(), 0
    while time.perf_counter() - start < seconds or count < 3:
        for _ in range(10):
            a @ b
        count += 10
        sync()
    elapsed = time.perf_counter() - start
    return {"tflops": 2 * n**3 * count / elapsed / 1e12, "shape": f"{n}^3", "dtype": str(dtype).split(".")[-1],
            "device": torch.cuda.get_device_name(0) if cuda else "cpu"}
