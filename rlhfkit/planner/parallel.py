"""Memory arithmetic of the parallel layouts beside DeepSpeed ZeRO: the FSDP2 backend (`--backend fsdp2`),
sequence parallelism (`--ring_attn_size`, DeepSpeed-Ulysses) and tensor parallelism (`--ds_tensor_parallel_size`).

Pure functions of numbers, like `rlhfkit/planner/memory.py`; `rlhfkit/planner/plan.py` calls them per role.

- FSDP2 (`rlhfkit/distributed/fsdp2_engine.py`): a trained model's shards are fp32 whatever `--bf16` says (bf16 is
  only the compute dtype of the gathered copy), and parameters, gradients and both AdamW moments are sharded over
  the data-parallel ranks (ZeRO-3's layout, Zhao et al. 2023, "PyTorch FSDP"): 4 + 4 + 8 = 16 bytes per parameter,
  / ranks. `--adam_offload` (CPUOffloadPolicy) keeps all three in host memory. While a unit runs its parameters are
  all-gathered in the compute dtype: the root unit (embeddings, final norm, LM head) stays gathered from the
  forward to the end of the backward, a decoder layer only while it runs (two at once with prefetching), and the
  unsharded gradients of one unit wait for their reduce-scatter.
- Sequence parallelism (Jacobs et al. 2023, "DeepSpeed Ulysses"): each of the P ranks of a group holds T/P tokens
  of every sample through every layer, so activations and logits divide by P; the attention all-to-alls give each
  rank H/P heads of all T tokens, and with fewer key/value heads than query heads the keys and values are repeated
  to every query head first, so the keys and values attention keeps are query-sized.
- Tensor parallelism (Shoeybi et al. 2019, "Megatron-LM", section 3): the q, k, v, o and MLP projections of each
  decoder layer split over the TP ranks (column-wise, then row-wise), so their weights and the activations between
  them (queries, keys, values, attention output, the MLP's 4i, the per-head statistics) divide by TP; embeddings,
  norms, the LM head and the hidden-size tensors around the projections do not. FSDP2 shards over world / TP.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlhfkit.planner.memory import ModelShape, layer_activation_elements

FSDP2_PREFETCHED_LAYERS = 2  # the running layer plus the next one, gathered ahead (FSDP2's implicit prefetch)
# On a CPU host, a rank of a multi-process (launcher) run peaks this many full copies of the model's weights (in its
# load dtype) above its rows: the model each rank loads whole, and the copy that sharding (fully_shard) or
# DeepSpeed's flattened groups make, whose pages the allocator keeps. Measured 2026-11-27 on the CPU dev machine
# (bench/planner_parallel.py's settings at max_len 32, where activations are small): the 25M-parameter Llama (88
# MiB of fp32 weights) at world 2 peaked 193 MiB (FSDP2) and 269 MiB (DeepSpeed ZeRO-2, --ring_attn_size 2) above
# the rows without this term; the 1M demo model within 30 MiB of them. Not used for one process (world 1), whose
# baseline `plan.CPU_PROCESS_BASELINE` was measured with it.
HOST_LOAD_COPIES = 2


@dataclass(frozen=True)
class Layout:
    """How one trained or frozen model is laid out over `world` ranks."""

    backend: str = "deepspeed"  # deepspeed | fsdp2
    world: int = 1
    sp: int = 1  # --ring_attn_size
    tp: int = 1  # --ds_tensor_parallel_size

    @property
    def shard_ranks(self) -> int:
        """Ranks a parameter's shards spread over: every rank, except the TP ranks that hold different slices."""
        return max(1, self.world // self.tp)


def host_load_bytes(shape: ModelShape, bf16: bool) -> float:
    """HOST_LOAD_COPIES full copies of the weights, 2 or 4 bytes per parameter."""
    return HOST_LOAD_COPIES * shape.params() * (2 if bf16 else 4)


def tp_params(shape: ModelShape, tp: int, lm_head: bool = True) -> float:
    """Parameters one TP rank holds before sharding: the decoder layers' projections / tp, the rest whole."""
    projections = shape.hidden_matrix_params()
    return shape.params(lm_head) - projections + projections / tp


def root_params(shape: ModelShape, lm_head: bool = True) -> int:
    """The root unit of FSDP2: what is not in a decoder layer (embeddings, final norm, LM head or value head)."""
    return shape.params(lm_head) - shape.num_layers * shape.layer_params()


@dataclass(frozen=True)
class FSDP2States:
    """Per-rank bytes of a model on FSDP2: its shards (`host`: on the host with --adam_offload) and the transient
    gathered parameters and unsharded gradients."""

    weights: float
    gradients: float
    optimizer: float
    gathered: float
    host: bool


def fsdp2_states(shape: ModelShape, layout: Layout, bf16: bool, *, trained: bool = True, lora: float = 0.0,
                 lm_head: bool = True, offload: bool = False) -> FSDP2States:
    """FSDP2 bytes per rank. A trained model's shards are fp32: weights 4 bytes per parameter, gradients 4 and
    AdamW 8 per trained one (all, or the `lora` adapter parameters), / shard ranks. A frozen one (`trained` False:
    reference, reward) keeps its load dtype (2 bytes with bf16). Gathered while running, in the compute dtype: the
    root unit + FSDP2_PREFETCHED_LAYERS layers (frozen: + one), plus, trained, the unsharded gradients of the root
    and one layer before their reduce-scatter."""
    n = layout.shard_ranks
    width = 2 if bf16 else 4
    params = tp_params(shape, layout.tp, lm_head)
    layer = (params - root_params(shape, lm_head)) / shape.num_layers
    root = root_params(shape, lm_head)
    if not trained:
        return FSDP2States(params * width / n, 0.0, 0.0, (root + layer) * width, False)
    gathered = (root + FSDP2_PREFETCHED_LAYERS * layer) * width + (root + layer) * width
    count = lora or params
    return FSDP2States(params * 4 / n, count * 4 / n, count * 8 / n, gathered, offload)


def tp_layer_elements(shape: ModelShape, seq_len: int, tp: int) -> float:
    """`layer_activation_elements` per token on one TP rank: the 4 hidden-size tensors around the projections (the
    two norms' inputs and outputs) stay whole, the rest (queries twice, attention output twice, keys, values, the
    MLP's 4i, the per-head statistics) divides by tp."""
    whole = 4 * shape.hidden_size
    return whole + (layer_activation_elements(shape, seq_len, False) - whole) / tp


def ulysses_extra_elements(shape: ModelShape, sp: int) -> float:
    """Elements per local token and layer that Ulysses keeps beyond one rank's layer: keys and values repeated to
    every query head (GQA, or key/value heads that do not split over sp) before the attention saves them."""
    if sp <= 1:
        return 0.0
    q_dim = shape.num_heads * shape.head_dim
    return 2.0 * (q_dim - shape.kv_dim)


@dataclass(frozen=True)
class ActivationTerms:
    """Peak activation bytes of one forward/backward on one rank, and what it is made of."""

    layers: float
    logits: float
    local_tokens: float

    @property
    def total(self) -> float:
        return self.layers + self.logits


def parallel_train_activations(shape: ModelShape, rows: int, seq_len: int, bf16: bool, checkpointing: bool,
                               layout: Layout, lm_head: bool = True, logit_copies: int = 3) -> ActivationTerms:
    """`memory.train_activations` on one rank of `layout`: its rows x seq_len / sp tokens, each layer's elements
    from `tp_layer_elements` plus `ulysses_extra_elements`; the logits of the rank's tokens (fp32, `logit_copies`
    copies; a value head: one number per token)."""
    tokens = rows * seq_len / layout.sp
    width = 2 if bf16 else 4
    per_token = tp_layer_elements(shape, seq_len, layout.tp) + ulysses_extra_elements(shape, layout.sp)
    per_layer = per_token * tokens * width
    if checkpointing:
        layers = shape.num_layers * tokens * shape.hidden_size * width + per_layer
    else:
        layers = shape.num_layers * per_layer
    logits = tokens * (shape.vocab_size if lm_head else 1) * 4 * logit_copies
    return ActivationTerms(layers, logits, tokens)


def parallel_activations(shape: ModelShape, rows: int, seq_len: int, bf16: bool, checkpointing: bool,
                         layout: Layout, *, train: bool, lm_head: bool) -> float:
    """Activation bytes of one rank: a training forward/backward (`parallel_train_activations`, 3 logit copies) or
    a forward without gradients (one layer's elements and 2 logit copies, as `memory.forward_activations`). No
    T x T term: Ulysses attends one causal call per sample (`rlhfkit.models.sequence_parallel.segment_attention`)."""
    copies = 3 if train else 2
    act = parallel_train_activations(shape, rows, seq_len, bf16, checkpointing and train, layout, lm_head, copies)
    return act.total if train else act.logits + act.layers / shape.num_layers
