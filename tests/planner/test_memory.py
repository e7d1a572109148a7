"""The planner's arithmetic (rlhfkit/planner/memory.py) against numbers computed by hand."""

from __future__ import annotations

import pytest

from rlhfkit.errors import UserError
from rlhfkit.planner import memory as mem
from tests.planner.memory_shapes import LLAMA2_7B, LLAMA2_70B, write_config

GB = 1e9


def shape(config: dict) -> mem.ModelShape:
    c = config
    return mem.ModelShape(c["vocab_size"], c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"],
                          c["num_attention_heads"], c["num_key_value_heads"],
                          c["hidden_size"] // c["num_attention_heads"], c["tie_word_embeddings"],
                          c["max_position_embeddings"])


L7, L70 = shape(LLAMA2_7B), shape(LLAMA2_70B)


def test_parameter_counts_match_the_published_llama2_sizes():
    # 7B: embed 32000*4096 + 32 layers x (4*4096^2 + 3*4096*11008 + 2*4096) + norm 4096 + head 32000*4096
    assert L7.params() == 131_072_000 + 32 * (67_108_864 + 135_266_304 + 8192) + 4096 + 131_072_000 == 6_738_415_616
    # 70B (GQA: 8 KV heads of 128): q,o 8192^2 each, k,v 8192*1024 each
    layer = 2 * 8192**2 + 2 * 8192 * 1024 + 3 * 8192 * 28672 + 2 * 8192
    assert L70.params() == 2 * 32000 * 8192 + 80 * layer + 8192 == 68_976_648_192
    # a critic / reward model replaces the LM head by a value head of hidden + 1
    assert L7.params(lm_head=False) == 6_738_415_616 - 131_072_000 + 4097


def test_bf16_weights_of_7b_are_14_gb_and_zero_stages_divide_by_the_ranks():
    p = L7.params()
    s0 = mem.trained_states(p, p, bf16=True, zero_stage=0, ranks=8)
    assert s0.weights / GB == pytest.approx(13.48, abs=0.01)  # 6.74B x 2 bytes
    assert s0.gradients == 2 * p and s0.optimizer == 12 * p  # ZeRO paper: 2 + 2 + K, K = 12
    s1 = mem.trained_states(p, p, True, 1, 8)
    assert (s1.weights, s1.gradients, s1.optimizer) == (2 * p, 2 * p, 12 * p / 8)
    s2 = mem.trained_states(p, p, True, 2, 8)
    assert (s2.weights, s2.gradients, s2.optimizer) == (2 * p, 2 * p / 8, 12 * p / 8)
    s3 = mem.trained_states(p, p, True, 3, 8)
    assert (s3.weights, s3.gradients, s3.optimizer) == (2 * p / 8, 2 * p / 8, 12 * p / 8)
    assert (s3.weights + s3.gradients + s3.optimizer) == 16 * p / 8  # 13.5 GB per GPU for 7B over 8
    off = mem.trained_states(p, p, True, 3, 8, adam_offload=True)
    assert off.optimizer == 0 and off.optimizer_host == 12 * p / 8
    fp32 = mem.trained_states(100, 100, bf16=False, zero_stage=0, ranks=1)
    assert (fp32.weights, fp32.gradients, fp32.optimizer) == (400, 400, 800)


def test_muon_keeps_one_momentum_for_the_hidden_matrices():
    # 7B: 32 layers x (4*4096^2 + 3*4096*11008) matrices on Muon (4 B each), the rest (embeddings, head, norms) on
    # AdamW (8 B each, fp32: Muon runs on one process in fp32)
    matrices = 32 * (4 * 4096**2 + 3 * 4096 * 11008)
    assert L7.hidden_matrix_params() == matrices
    p = L7.params()
    st = mem.trained_states(p, p, False, 0, 1, muon_params=matrices)
    assert st.optimizer == 4 * matrices + 8 * (p - matrices)


def test_lora_trains_only_the_adapters():
    # rank 8 on q,k,v,o,gate,up,down of one 7B layer: r x (in + out) each
    per_layer = 8 * (4 * (4096 + 4096) + 3 * (4096 + 11008))
    assert L7.lora_params(8) == 32 * per_layer
    st = mem.trained_states(L7.params(), L7.lora_params(8), True, 0, 1)
    assert st.weights == 2 * L7.params() and st.gradients == 2 * L7.lora_params(8)


def test_qlora_keeps_4_bit_base_weights():
    # 6.738B x (0.5 + 0.127 / 8) bytes = 3.48 GB, plus the rank-8 adapters in bf16
    got = mem.qlora_weights(L7.params(), L7.lora_params(8))
    assert got == pytest.approx(6_738_415_616 * 0.5158750 + 2 * L7.lora_params(8))
    assert got / GB == pytest.approx(3.517, abs=0.01)


def test_frozen_models_hold_only_weights():
    assert mem.frozen_weights(1000, bf16=True, zero_stage=2, ranks=4) == 2000
    assert mem.frozen_weights(1000, bf16=True, zero_stage=3, ranks=4) == 500


def test_activations_by_hand():
    s = mem.ModelShape(vocab_size=10, hidden_size=4, intermediate_size=8, num_layers=2, num_heads=2, num_kv_heads=1,
                       head_dim=2, tie_word_embeddings=True)
    per_token_layer = 8 * 4 + 2 * 2 + 4 * 8 + 2  # 70 elements: 8h + 2kv + 4i + heads
    tokens = 3 * 5
    logits = tokens * 10 * 4 * 3
    assert mem.train_activations(s, 3, 5, bf16=False, checkpointing=False) == 2 * per_token_layer * tokens * 4 + logits
    ckpt = 2 * tokens * 4 * 4 + per_token_layer * tokens * 4 + logits  # layer inputs + one recomputed layer
    assert mem.train_activations(s, 3, 5, bf16=False, checkpointing=True) == ckpt
    eager = (per_token_layer + 2 * 5) * tokens * 2 * 2 + logits  # + heads x seq softmax per token, bf16
    assert mem.train_activations(s, 3, 5, bf16=True, checkpointing=False, eager_attention=True) == eager


def test_kv_cache_and_vllm_blocks():
    # 7B, bf16: 2 (k, v) x 32 layers x 32 heads x 128 x 2 bytes = 512 KiB per token; TP 2 halves it
    assert mem.kv_bytes_per_token(L7, True) == 524_288
    assert mem.kv_bytes_per_token(L7, True, tensor_parallel=2) == 262_144
    # 70B has 8 KV heads: TP 16 still keeps one whole head per device
    assert mem.kv_bytes_per_token(L70, True, tensor_parallel=16) == 2 * 80 * 1 * 128 * 2
    b = mem.vllm_budget(L7, 80 * mem.GIB, 0.5, 2, 2049)
    assert b.reserved == 40 * mem.GIB and b.weights == L7.params()
    kv = 40 * mem.GIB * 0.95 - L7.params()
    assert b.kv_cache == kv and b.blocks == int(kv // (16 * 262_144)) and b.tokens == 16 * b.blocks
    assert b.sequences == b.tokens // 2049
    small = mem.vllm_budget(L7, 16 * mem.GIB, 0.5, 1, 4096)
    assert small.kv_cache == 0 and small.sequences == 0  # 13.5 GB of weights in 8 GiB: vLLM cannot start


def test_vllm_cpu_kv_cache_is_sized_from_the_run():
    # tiny demo shape: 2 (k, v) x 4 layers x 2 KV heads x 32 x 4 bytes (fp32) = 2 KiB per token; a block of 128
    # tokens 256 KiB. 16 prompts x 8 samples of at most 64 + 32 + 1 = 97 tokens: one block each, 128 blocks = 32 MiB,
    # x 1.25 = 40 MiB, + 2 blocks (0.5 MiB) = 40.5 MiB, rounded up to 41 MiB
    size = mem.vllm_cpu_kv_cache_bytes(2048, 128, 97)
    assert size == 41 * mem.MIB
    # vLLM makes size // block bytes blocks, one of them its null block: every one of the 128 sequences fits at once
    assert size // (128 * 2048) - 1 >= 128
    # a 300-token context takes 3 blocks a sequence: 128 x 3 x 256 KiB x 1.25 + 0.5 MiB = 120.5 -> 121 MiB
    assert mem.vllm_cpu_kv_cache_bytes(2048, 128, 300) == 121 * mem.MIB
    # more sequences than vLLM runs at once (max_num_seqs, 256 by default on CPU; 0 = unknown) count as that many
    assert mem.vllm_cpu_kv_cache_bytes(2048, 1000, 97) == mem.vllm_cpu_kv_cache_bytes(2048, 0, 97) == 81 * mem.MIB
    assert mem.vllm_cpu_kv_cache_bytes(2048, 1000, 97, max_num_seqs=192) == 61 * mem.MIB  # 48 MiB x 1.25 + 0.5
    # small runs get the 32 MiB floor, large ones the 1 GiB cap (what every engine held before)
    assert mem.vllm_cpu_kv_cache_bytes(2048, 2, 97) == 32 * mem.MIB
    assert mem.vllm_cpu_kv_cache_bytes(mem.kv_bytes_per_token(L7, True), 64, 1024) == mem.GIB
    # ... but never less than one full-length sequence: 7B bf16 (512 KiB a token), 4,096 tokens = 32 blocks of
    # 64 MiB, + 2 blocks = 2,176 MiB
    assert mem.vllm_cpu_kv_cache_bytes(mem.kv_bytes_per_token(L7, True), 64, 4096) == 2176 * mem.MIB


def test_mixture_of_experts_counts_every_expert_and_activates_top_k(tmp_path):
    # Mixtral-8x7B's config: 8 experts of 14336, 2 per token, 32 layers, hidden 4096, GQA 8 KV heads, vocab 32000
    mixtral = {**LLAMA2_7B, "intermediate_size": 14336, "num_key_value_heads": 8, "num_local_experts": 8,
               "num_experts_per_tok": 2, "max_position_embeddings": 32768}
    s = mem.read_model_shape(str(write_config(tmp_path / "mixtral", mixtral)))
    layer = 2 * 4096**2 + 2 * 4096 * 1024 + 8 * 3 * 4096 * 14336 + 4096 * 8 + 2 * 4096
    assert s.params() == 2 * 32000 * 4096 + 32 * layer + 4096 == 46_702_792_704  # Mixtral's published 46.7B
    assert mem.layer_activation_elements(s, 1, False) == 8 * 4096 + 2 * 1024 + 4 * 2 * 14336 + 8 + 32


def test_reads_a_directory_holding_only_config_json(tmp_path):
    got = mem.read_model_shape(str(write_config(tmp_path / "m", LLAMA2_70B)))
    assert got == L70
    with pytest.raises(UserError, match="config.json"):
        mem.read_model_shape(str(tmp_path / "missing"))
