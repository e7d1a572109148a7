"""Write a tiny llama GGUF file from the demo model, so the GGUF tests need no download.

The layout follows what Transformers' GGUF loader reads back (`transformers.modeling_gguf_pytorch_utils`): llama
metadata keys, tensors named by gguf's own name map, the q/k projections stored in llama.cpp's rotary order (the
loader undoes it), no `output.weight` for tied embeddings, and the byte-level BPE tokenizer as `gpt2` with its
merges, its special tokens marked CONTROL and the chat template.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

CONTROL = 3  # gguf.TokenType.CONTROL
NORMAL = 1


def _rotary_order(weight: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp keeps each head's rotary halves interleaved: rows (2, dim) of a head become (dim, 2)."""
    dim = weight.shape[0] // n_head // 2
    return weight.reshape(n_head, 2, dim, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _add_tokenizer(writer, model_dir: Path) -> None:
    spec = json.loads((model_dir / "tokenizer.json").read_text())
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    vocab = dict(spec["model"]["vocab"])
    for added in spec.get("added_tokens", []):
        vocab[added["content"]] = added["id"]
    tokens = [tok for tok, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {added["content"] for added in spec.get("added_tokens", []) if added.get("special")}
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([CONTROL if tok in special else NORMAL for tok in tokens])
    writer.add_token_merges(merges)
    ids = {tok: i for i, tok in enumerate(tokens)}
    writer.add_bos_token_id(ids[config.get("bos_token") or "<s>"])
    writer.add_eos_token_id(ids[config.get("eos_token") or "</s>"])
    writer.add_pad_token_id(ids[config.get("pad_token") or "<pad>"])
    template = config.get("chat_template")
    if template is None and (model_dir / "chat_template.jinja").is_file():
        template = (model_dir / "chat_template.jinja").read_text()
    if template:
        writer.add_chat_template(template)


def write_demo_gguf(model_dir: str | Path, out: str | Path) -> Path:
    """The demo model of `model_dir` (a llama with tied embeddings) as a float32 GGUF file at `out`."""
    import gguf
    import torch
    from transformers import AutoConfig

    model_dir, out = Path(model_dir), Path(out)
    cfg = AutoConfig.from_pretrained(model_dir)
    from safetensors.torch import load_file

    state = load_file(str(model_dir / "model.safetensors"))
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    writer = gguf.GGUFWriter(str(out), "llama")
    writer.add_name("rlhfkit-demo")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(getattr(cfg, "rope_theta", None) or 10000.0))
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    _add_tokenizer(writer, model_dir)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg.num_hidden_layers)
    for hf_name, tensor in state.items():
        if hf_name == "lm_head.weight":  # tied to the embeddings: a GGUF without output.weight says so
            continue
        array = tensor.to(torch.float32).numpy()
        if hf_name.endswith("self_attn.q_proj.weight"):
            array = _rotary_order(array, cfg.num_attention_heads)
        elif hf_name.endswith("self_attn.k_proj.weight"):
            array = _rotary_order(array, cfg.num_key_value_heads)
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise ValueError(f"no GGUF name for {hf_name}")
        writer.add_tensor(name, np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
