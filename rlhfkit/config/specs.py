"""The small specs of the RL roles, the rollout engines and the Ray placement: what each part needs, derived once
from a validated config (`rlhfkit.config.rl_specs.rl_specs` for an RL run, `rlhfkit.config.batch_inference.
engine_spec` for batch inference).

The parts below the RL stack (`models`, `distributed`, `rollout`, `agents`) take these specs, never the RL config:
an actor needs its model, its optimizer and loss settings and how to cut its batches, not the prompt data or the
reward flags. Specs are frozen and picklable (they travel to Ray actors). The model and strategy sections
(`ModelArgs`, `StrategyArgs`) are the ones every trainer shares; a spec holds a copy of them.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlhfkit.config.common import ModelArgs, StrategyArgs

ENGINE_BACKENDS = ("transformers", "vllm")
#: The LoRA ranks a vLLM 0.32 engine can reserve an adapter slot for (its `max_lora_rank` choices).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
#: Added to the message about a critic initialisation without a trained value head.
CRITIC_HEAD_HINT = ", or add --critic_init_head to start the critic's head from scratch on purpose"


@dataclass(frozen=True, kw_only=True)
class BatchSpec:
    """How a role cuts a batch into forwards (scoring) and optimizer steps (training)."""

    train_batch_size: int  # samples per optimizer step, all ranks (--train_batch_size)
    micro_train_batch_size: int  # samples per forward/backward on one rank
    micro_rollout_batch_size: int  # rows per scoring forward (log-probs, values, rewards)
    max_tokens_per_gpu: int | None  # token budget of a micro-batch (--use_dynamic_batch); None: cut by rows
    scoring_max_tokens_per_gpu: int | None = None  # the scoring forwards' budget; None: max_tokens_per_gpu's
    packed: bool  # --packing_samples: forwards on packed rows
    max_epochs: int  # passes over each rollout batch when training on it


@dataclass(frozen=True, kw_only=True)
class RoleSpec:
    """What every model role has: its model and strategy sections, its batch cutting, the checkpoint layout."""

    model: ModelArgs  # --pretrain, dtype (--bf16), attention, LoRA, gradient checkpointing
    strategy: StrategyArgs  # ZeRO stage, offload, optimizer settings, seed, timeouts
    batch: BatchSpec
    universal_ckpt: bool = False  # --use_ds_universal_ckpt


@dataclass(frozen=True, kw_only=True)
class ActorSpec(RoleSpec):
    """The policy being trained (PPO-clip policy loss, Schulman et al. 2017, with its variants)."""

    learning_rate: float
    temperature: float  # log-probs are taken at the sampling temperature
    clip_low: float
    clip_high: float
    dual_clip: float | None
    loss_agg: str  # how the per-token loss is reduced (rlhfkit.algorithms.masking.aggregate_loss)
    loss_norm_len: int | None  # seq_mean_token_sum_norm's constant length (--generate_max_len), else None
    policy_loss_type: str  # ppo, gspo, cispo or sapo
    tau_pos: float  # SAPO's gate temperatures
    tau_neg: float
    is_correction: bool  # --enable_vllm_is_correction
    is_correction_type: str
    is_low: float
    is_high: float
    kl_estimator: str
    use_kl_loss: bool
    entropy_loss_coef: float
    aux_loss_coef: float
    ema_beta: float | None  # --enable_ema's decay, None without EMA
    save_hf_ckpt: bool  # also a Hugging Face model inside every checkpoint
    distill_loss: str | None = None  # on-policy distillation's loss (reverse_kl, topk_forward_kl); None: none
    distill_coef: float = 1.0  # its weight beside the policy loss
    distill_only: bool = False  # no policy-gradient term
    freeze_visual_encoder: bool = False  # a vision-language policy trains its language model only (and syncs it)


@dataclass(frozen=True, kw_only=True)
class CriticSpec(RoleSpec):
    """The value model of PPO (`--advantage_estimator gae`)."""

    path: str | None  # --critic_pretrain, else --reward_pretrain, else --pretrain (None: not given, an error later)
    value_head_prefix: str
    require_head: bool  # the initialisation must carry a trained value head
    learning_rate: float
    value_clip: float | None


@dataclass(frozen=True, kw_only=True)
class ReferenceSpec(RoleSpec):
    """The frozen initial policy (reference log-probs for the KL term)."""

    path: str | None  # --pretrain
    temperature: float


@dataclass(frozen=True, kw_only=True)
class TeacherSpec(RoleSpec):
    """The frozen teacher of on-policy distillation: log-probs of the student's sampled tokens (and its top-k)."""

    path: str | None  # --teacher_pretrain
    temperature: float  # the student's sampling temperature, so both sides score the same distribution
    topk: int  # the teacher's most likely tokens sent per position (0: only the sampled token's log-prob)


@dataclass(frozen=True, kw_only=True)
class RewardSpec(RoleSpec):
    """A trained reward model, read at each sample's last token."""

    path: str | None  # --reward_pretrain
    value_head_prefix: str
    normalize: bool  # --normalize_reward: the mean/std stored in the reward model's config


@dataclass(frozen=True, kw_only=True)
class EngineSpec:
    """A rollout engine (the Transformers engine or vLLM) and how many of them a run starts."""

    backend: str  # one of ENGINE_BACKENDS
    model: str | None  # the policy's model directory (checked where the engine loads it)
    use_fast_tokenizer: bool
    bf16: bool
    attn_implementation: str  # Transformers engine: the attention asked for (checked where the model loads)
    max_batch_size: int  # Transformers engine: most sequences per forward
    num_engines: int = 1  # engine actors of a Ray run (1 in-process engine otherwise)
    tensor_parallel_size: int = 1  # vLLM: devices per engine
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False  # vLLM: no CUDA graphs (always on CPU)
    enable_prefix_caching: bool = False
    seed: int = 0
    max_model_len: int | None = None  # prompt + response + 1 (capped by the model's positions when built)
    enable_sleep: bool = False  # vLLM sleep mode between rollouts
    max_num_seqs: int | None = None  # vLLM: most sequences at once (None: vLLM's default)
    lora_rank: int = 0  # adapter-only sync (--lora_sync): the rank of the engine's LoRA adapter slot; 0: no slot
    generate_batch: int = 0  # most sequences one generate call hands an engine (sizes vLLM's CPU KV cache); 0: unknown

    @property
    def vllm_lora_slot_rank(self) -> int:
        """vLLM's `max_lora_rank` for the adapter slot: the least rank it offers that holds `lora_rank`."""
        return next(r for r in VLLM_LORA_RANKS if r >= self.lora_rank)

    @property
    def placement_role(self) -> str:
        """The name the placement and the memory plan give these engines."""
        return "vllm" if self.backend == "vllm" else "hf_engine"

    @property
    def devices_per_engine(self) -> int:
        return self.tensor_parallel_size if self.backend == "vllm" else 1


@dataclass(frozen=True, kw_only=True)
class PlacementSpec:
    """Where the roles of a Ray run go: the roles the run has with their ranks, the engines, colocation, and which
    roles leave the device between calls (`rlhfkit.distributed.placement`)."""

    role_ranks: tuple[tuple[str, int], ...]  # (role, ranks) of the roles the run has, actor first
    engine_role: str  # "vllm" or "hf_engine"
    engine_ranks: int
    engine_devices_per_rank: int
    colocate_all: bool = False
    colocate_actor_ref: bool = False
    colocate_critic_reward: bool = False
    offload_between_calls: tuple[str, ...] = ()  # roles whose states leave the device between calls
    sync_backend: str = "nccl"  # --vllm_sync_backend (nccl falls back to the object store without GPUs)
    ddp_timeout: float = 1800.0  # seconds a collective of a role group (or the weight-sync group) waits


@dataclass(frozen=True, kw_only=True)
class RLSpecs:
    """The specs of one RL run: a role is None when the run does not have it (no critic without GAE, no reference
    without a KL term, no reward model with a reward function, HTTP servers or an agent)."""

    actor: ActorSpec
    critic: CriticSpec | None
    ref: ReferenceSpec | None
    reward: RewardSpec | None
    engine: EngineSpec
    placement: PlacementSpec
    teacher: TeacherSpec | None = None  # a local distillation teacher (--teacher_pretrain)
