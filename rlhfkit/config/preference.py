"""Configs of the preference trainers (`train_rm`, `train_dpo`, `train_kto`) and of the reward server (`serve_rm`).

Each trainer config reuses the shared sections (model, strategy, data, logging, checkpoint) and adds the flags
of its method under OpenRLHF's names (`--chosen_key`, `--beta`, `--ipo`, `--label_smoothing`, `--ref_offload`,
...). Field names are unique across one config, so the pair-data keys live in their own section and KTO's
unpaired data reuses `--input_key` / `--output_key` from DataArgs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rlhfkit.config.base import arg
from rlhfkit.config.common import (
    CheckpointArgs,
    DataArgs,
    DryRunArgs,
    LoggingArgs,
    ModelArgs,
    StrategyArgs,
    validate_dynamic_batch,
)
from rlhfkit.errors import UserError

RM_LOSSES = ("sigmoid", "logexp")


@dataclass
class PairDataArgs:
    prompt_key: str | None = arg(None, "Record key of the prompt. Without it, chosen/rejected are whole texts, or "
                                       "(with --apply_chat_template) whole conversations sharing their prompt.")
    chosen_key: str = arg("chosen", "Record key of the preferred response (text or messages).")
    rejected_key: str = arg("rejected", "Record key of the dispreferred response (text or messages).")
    margin_key: str | None = arg(None, "Record key of a per-pair margin the chosen reward must win by "
                                       "(reward model only).")


@dataclass
class UnpairedDataArgs:
    label_key: str = arg("label", "Record key of the KTO label: true/1 desirable, false/0 undesirable.")


@dataclass
class LoopArgs:
    """Fields every preference trainer loop reads."""

    max_epochs: int = arg(1, "Passes over the training data.")
    max_steps: int = arg(-1, "Stop after this many optimizer steps (-1: run every epoch); the learning-rate "
                             "schedule still spans the whole run.")
    aux_loss_coef: float = arg(0.0, "Weight of the mixture-of-experts load-balancing loss (MoE models only).")
    compute_fp32_loss: bool = arg(False, "Compute log-probs / rewards and the loss in float32 under --bf16.")


@dataclass
class RMTrainArgs(LoopArgs):
    loss: str = arg("sigmoid", "Pairwise loss: -log sigmoid(r_c - r_r - margin), or its log(1+exp) form.",
                    choices=RM_LOSSES)
    value_head_prefix: str = arg("score", "Attribute name of the linear reward head.")
    normalize_reward: bool = arg(False, "Mark the saved model as normalised: consumers (serve_rm, PPO) then "
                                        "divide (r - reward_mean) by reward_std by default. The statistics are "
                                        "always computed and saved.")
    reward_stats_samples: int = arg(-1, "Training pairs scored after training for reward_mean / reward_std "
                                        "(-1: all).")


@dataclass
class ReferenceArgs:
    ref_pretrain: str | None = arg(None, "Frozen reference model (default: --pretrain).")
    ref_offload: bool = arg(False, "Keep the reference model on the CPU between its forward passes (ZeRO-3: "
                                   "parameter offload).")


@dataclass
class DPOTrainArgs(LoopArgs):
    beta: float = arg(0.1, "DPO temperature: strength of the implicit KL penalty to the reference.")
    ipo: bool = arg(False, "IPO loss (Azar et al. 2023) on per-token mean log-probs instead of DPO.")
    label_smoothing: float = arg(0.0, "cDPO (Mitchell 2023): assumed probability that a preference label is "
                                      "flipped, in [0, 0.5).")
    nll_loss_coef: float = arg(0.0, "Weight of the NLL term on the chosen responses (RPO, Pang et al. 2024).")


@dataclass
class KTOTrainArgs(LoopArgs):
    beta: float = arg(0.1, "KTO temperature.")
    desirable_loss_weight: float = arg(1.0, "Weight of the desirable examples' loss (lambda_D).")
    undesirable_loss_weight: float = arg(1.0, "Weight of the undesirable examples' loss (lambda_U).")


@dataclass
class RMConfig:
    model: ModelArgs = field(default_factory=ModelArgs)
    strategy: StrategyArgs = field(default_factory=StrategyArgs)
    data: DataArgs = field(default_factory=DataArgs)
    pairs: PairDataArgs = field(default_factory=PairDataArgs)
    train: RMTrainArgs = field(default_factory=RMTrainArgs)
    logging: LoggingArgs = field(default_factory=LoggingArgs)
    checkpoint: CheckpointArgs = field(default_factory=CheckpointArgs)
    plan: DryRunArgs = field(default_factory=DryRunArgs)


@dataclass
class DPOConfig:
    model: ModelArgs = field(default_factory=ModelArgs)
    reference: ReferenceArgs = field(default_factory=ReferenceArgs)
    strategy: StrategyArgs = field(default_factory=StrategyArgs)
    data: DataArgs = field(default_factory=DataArgs)
    pairs: PairDataArgs = field(default_factory=PairDataArgs)
    train: DPOTrainArgs = field(default_factory=DPOTrainArgs)
    logging: LoggingArgs = field(default_factory=LoggingArgs)
    checkpoint: CheckpointArgs = field(default_factory=CheckpointArgs)
    plan: DryRunArgs = field(default_factory=DryRunArgs)


@dataclass
class KTOConfig:
    model: ModelArgs = field(default_factory=ModelArgs)
    reference: ReferenceArgs = field(default_factory=ReferenceArgs)
    strategy: StrategyArgs = field(default_factory=StrategyArgs)
    data: DataArgs = field(default_factory=DataArgs)
    unpaired: UnpairedDataArgs = field(default_factory=UnpairedDataArgs)
    train: KTOTrainArgs = field(default_factory=KTOTrainArgs)
    logging: LoggingArgs = field(default_factory=LoggingArgs)
    checkpoint: CheckpointArgs = field(default_factory=CheckpointArgs)
    plan: DryRunArgs = field(default_factory=DryRunArgs)


@dataclass
class ServeRMConfig:
    reward_pretrain: str | None = arg(None, "Reward model directory (written by train_rm).")
    host: str = arg("127.0.0.1", "Address to bind. The default serves this machine only; 0.0.0.0 exposes the "
                                 "server to the network (set --api_key then).")
    port: int = arg(5000, "TCP port (0: pick a free one).")
    api_key: str | None = arg(None, "Require `Authorization: Bearer <key>` (default: env RLHFKIT_RM_API_KEY).")
    normalize_reward: bool | None = arg(None, "Return (r - reward_mean) / reward_std with the statistics saved by "
                                              "train_rm (default: as the saved model says).")
    value_head_prefix: str = arg("score", "Attribute name of the linear reward head.")
    max_len: int = arg(2048, "Truncate each query to this many tokens (the end is kept: the reward is read "
                             "at the last token).")
    batch_size: int = arg(16, "Most queries scored in one forward pass.")
    batch_wait_ms: float = arg(5.0, "How long the batching worker waits for more requests to fill a batch.")
    max_body_bytes: int = arg(10 * 2**20, "Largest request body accepted (bigger ones get 413).")
    max_queries_per_request: int = arg(4096, "Most queries in one request (more get 413; rlhfkit's own client "
                                             "splits its batches to fit).")
    request_timeout: float = arg(300.0, "Seconds a request may wait for its scores; then it gets 503 and its "
                                        "unscored queries are dropped.")
    client_timeout: float = arg(30.0, "Seconds a client may take to send its whole request body (slower ones get "
                                      "408).")
    bf16: bool = arg(False, "Run the reward model in bfloat16.")
    attn_implementation: str = arg("sdpa", "Attention kernel.", choices=("sdpa", "eager", "flash_attention_2"))
    flash_attn: bool = arg(False, "Use flash_attention_2.")
    disable_fast_tokenizer: bool = arg(False, "Load the slow (Python) tokenizer.")


def validate_serve_rm_config(cfg: ServeRMConfig) -> None:
    """Fail fast, before the model loads, on settings the server cannot run with."""
    if not cfg.reward_pretrain:
        raise UserError("--reward_pretrain is required: the reward model directory written by train_rm")
    if not 0 <= cfg.port <= 65535:
        raise UserError(f"--port {cfg.port} is not a TCP port; use 1-65535 (or 0 to pick a free one)")
    for flag in ("max_len", "batch_size", "max_body_bytes", "max_queries_per_request"):
        if getattr(cfg, flag) < 1:
            raise UserError(f"--{flag} must be at least 1 (got {getattr(cfg, flag)})")
    for flag in ("request_timeout", "client_timeout"):
        if not getattr(cfg, flag) > 0:
            raise UserError(f"--{flag} must be a positive number of seconds (got {getattr(cfg, flag)})")
    if cfg.batch_wait_ms < 0:
        raise UserError(f"--batch_wait_ms must be >= 0 (got {cfg.batch_wait_ms})")


def validate_rm_config(cfg: RMConfig) -> None:
    """Fail fast on settings that cannot run."""
    if not cfg.data.dataset:
        raise UserError("--dataset is required: preference pairs as a local json/jsonl/parquet/csv/arrow file or "
                        "dataset directory")
    _check_loop(cfg.train)
    _check_pair_budget(cfg)


def validate_dpo_config(cfg: DPOConfig) -> None:
    if not cfg.data.dataset:
        raise UserError("--dataset is required: preference pairs as a local json/jsonl/parquet/csv/arrow file or "
                        "dataset directory")
    t = cfg.train
    _check_loop(t)
    _check_pair_budget(cfg)
    if t.beta <= 0:
        raise UserError(f"--beta must be > 0 (got {t.beta})")
    if not 0.0 <= t.label_smoothing < 0.5:
        raise UserError(f"--label_smoothing must be in [0, 0.5) (got {t.label_smoothing})")
    if t.ipo and t.label_smoothing > 0:
        raise UserError("--label_smoothing (cDPO) does not apply to --ipo; drop one of the two flags")
    if t.nll_loss_coef < 0:
        raise UserError(f"--nll_loss_coef must be >= 0 (got {t.nll_loss_coef})")


def validate_kto_config(cfg: KTOConfig) -> None:
    if not cfg.data.dataset:
        raise UserError("--dataset is required: unpaired completions with labels as a local json/jsonl/parquet/"
                        "csv/arrow file or dataset directory")
    t = cfg.train
    _check_loop(t)
    if t.beta <= 0:
        raise UserError(f"--beta must be > 0 (got {t.beta})")
    if t.desirable_loss_weight < 0 or t.undesirable_loss_weight < 0:
        raise UserError("--desirable_loss_weight and --undesirable_loss_weight must be >= 0")
    if cfg.strategy.use_dynamic_batch:
        raise UserError("--use_dynamic_batch is not supported by train_kto yet: KTO's KL reference point is "
                        "estimated within each micro-batch, so a token-budget split would change the loss; use "
                        "--micro_train_batch_size")
    validate_dynamic_batch(cfg.strategy, cfg.data.max_len, "--max_len")
    if cfg.strategy.micro_train_batch_size < 2:
        raise UserError("KTO needs --micro_train_batch_size >= 2: its KL reference point pairs each prompt with "
                        "another sample's completion from the same micro batch")


def _check_loop(t: LoopArgs) -> None:
    if t.max_epochs < 1:
        raise UserError(f"--max_epochs must be >= 1 (got {t.max_epochs})")


def _check_pair_budget(cfg: RMConfig | DPOConfig) -> None:
    validate_dynamic_batch(cfg.strategy, 2 * cfg.data.max_len, "2 x --max_len: a chosen and a rejected row")
