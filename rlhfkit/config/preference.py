"""Configs of the preference trainers (`train_rm`, `train_dpo`, `train_kto`) and of the reward server (`serve_rm`).

Each trainer config reuses the shared sections (model, strategy, data, logging, checkpoint) and adds the flags
of its method under OpenRLHF's names (`--chosen_key`, `--beta`, `--ipo`, `--label_smoothing`, `--ref_offload`,
...). Field names are unique across one config, so the pair-data keys live in their own section and KTO's
unpaired data reuses `--input_key` / `--output_key` from DataArgs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rlhfkit.config.base import arg, validate_sections, with_default
from rlhfkit.config.common import (
    CheckpointArgs,
    DataArgs,
    DryRunArgs,
    LoggingArgs,
    ModelArgs,
    StrategyArgs,
    check_aux_loss_flags,
    check_loop_counts,
    check_token_budget,
)
from rlhfkit.config.devices import ATTN_CHOICES, ATTN_HELP, AUTO
from rlhfkit.config.names import DPO_LOSS_TYPES, REFERENCE_FREE_DPO_LOSSES, RM_LOSS_KINDS
from rlhfkit.config.paths import check_output_paths
from rlhfkit.config.sequence_parallel import check_ring_combinations, refuse_ring_attn
from rlhfkit.config.serving import server_api_key
from rlhfkit.config.vision import VisionArgs, check_vision_flags, vision_inert_flags
from rlhfkit.errors import UserError

#: serve_rm's bearer token when --api_key is not given (the HTTP reward client reads it too).
SERVE_RM_KEY_ENV = "RLHFKIT_RM_API_KEY"


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

    def validate(self) -> None:
        check_loop_counts(self.max_epochs, self.max_steps)


@dataclass
class RMTrainArgs(LoopArgs):
    loss: str = arg("sigmoid", "Pairwise loss: -log sigmoid(r_c - r_r - margin), or its log(1+exp) form.",
                    choices=RM_LOSS_KINDS)
    value_head_prefix: str = arg("score", "Attribute name of the linear reward head.")
    normalize_reward: bool = arg(False, "Mark the saved model as normalised: consumers (serve_rm, PPO) then "
                                        "divide (r - reward_mean) by reward_std by default. The statistics are "
                                        "always computed and saved.")
    reward_stats_samples: int = arg(-1, "Training pairs scored after training for reward_mean / reward_std "
                                        "(-1: all).")

    def validate(self) -> None:
        super().validate()
        if self.aux_loss_coef != 0:
            raise UserError("--aux_loss_coef is not supported by train_rm (the reward head reads the backbone, which "
                            "returns no router loss); drop it")


@dataclass
class ReferenceArgs:
    ref_pretrain: str | None = arg(None, "Frozen reference model (default: --pretrain).")
    ref_offload: bool = arg(False, "Keep the reference model on the CPU between its forward passes (ZeRO-3: "
                                   "parameter offload).")


@dataclass
class DPOTrainArgs(LoopArgs):
    loss_type: str = arg("sigmoid", "Preference loss, spelled as in TRL: sigmoid (DPO, with its --ipo / "
                                    "--label_smoothing variants); simpo (Meng et al. 2024: length-normalised, "
                                    "reference-free, margin --simpo_gamma; TRL's CPO loss_type simpo); orpo (Hong et "
                                    "al. 2024: the chosen NLL plus --beta x the odds-ratio term, reference-free). "
                                    "simpo and orpo load no reference model.", choices=DPO_LOSS_TYPES)
    beta: float = arg(0.1, "DPO temperature: strength of the implicit KL penalty to the reference. SimPO: the "
                           "reward scale (the paper uses 2 to 10). ORPO: lambda, the weight of the odds-ratio "
                           "term (TRL's ORPO beta; the paper uses 0.1 to 1).")
    simpo_gamma: float = arg(0.5, "SimPO's target reward margin gamma, in reward units (TRL's name and default).")
    ipo: bool = arg(False, "IPO loss (Azar et al. 2023) on per-token mean log-probs instead of DPO.")
    label_smoothing: float = arg(0.0, "cDPO (Mitchell 2023): assumed probability that a preference label is "
                                      "flipped, in [0, 0.5).")
    nll_loss_coef: float = arg(0.0, "Weight of the NLL term on the chosen responses (RPO, Pang et al. 2024; with "
                                    "--loss_type simpo it is TRL's --cpo_alpha, CPO-SimPO).")

    def validate(self) -> None:
        super().validate()
        if self.beta <= 0:
            raise UserError(f"--beta must be > 0 (got {self.beta})")
        if not 0.0 <= self.label_smoothing < 0.5:
            raise UserError(f"--label_smoothing must be in [0, 0.5) (got {self.label_smoothing})")
        if self.ipo and self.label_smoothing > 0:
            raise UserError("--label_smoothing (cDPO) does not apply to --ipo; drop one of the two flags")
        if self.nll_loss_coef < 0:
            raise UserError(f"--nll_loss_coef must be >= 0 (got {self.nll_loss_coef})")
        self._validate_reference_free()

    def _validate_reference_free(self) -> None:
        if self.loss_type not in REFERENCE_FREE_DPO_LOSSES:
            return
        if self.ipo or self.label_smoothing > 0:
            raise UserError(f"--ipo and --label_smoothing are DPO variants; --loss_type {self.loss_type} takes "
                            "neither")
        if self.simpo_gamma < 0:
            raise UserError(f"--simpo_gamma must be >= 0 (got {self.simpo_gamma})")
        if self.loss_type == "orpo" and self.nll_loss_coef > 0:
            raise UserError("--loss_type orpo already holds the chosen NLL term with weight 1 (--beta weighs the "
                            "odds-ratio term); drop --nll_loss_coef")


@dataclass
class KTOTrainArgs(LoopArgs):
    beta: float = arg(0.1, "KTO temperature.")
    desirable_loss_weight: float = arg(1.0, "Weight of the desirable examples' loss (lambda_D).")
    undesirable_loss_weight: float = arg(1.0, "Weight of the undesirable examples' loss (lambda_U).")

    def validate(self) -> None:
        super().validate()
        if self.beta <= 0:
            raise UserError(f"--beta must be > 0 (got {self.beta})")
        if self.desirable_loss_weight < 0 or self.undesirable_loss_weight < 0:
            raise UserError("--desirable_loss_weight and --undesirable_loss_weight must be >= 0")


# OpenRLHF 0.11's own defaults of train_rm and train_dpo (docs/migration.md#defaults lists the ones rlhfkit keeps)
@dataclass
class RMStrategyArgs(StrategyArgs):
    micro_train_batch_size: int = with_default(StrategyArgs, "micro_train_batch_size", 1)
    learning_rate: float = with_default(StrategyArgs, "learning_rate", 9e-6)


@dataclass
class DPOStrategyArgs(StrategyArgs):
    learning_rate: float = with_default(StrategyArgs, "learning_rate", 1e-5)


@dataclass
class PreferenceDataArgs(DataArgs):
    max_len: int = with_default(DataArgs, "max_len", 512)


@dataclass
class DPODataArgs(PreferenceDataArgs):
    eval_split: str = with_default(DataArgs, "eval_split", "test")


@dataclass
class RMConfig:
    model: ModelArgs = field(default_factory=ModelArgs)
    strategy: RMStrategyArgs = field(default_factory=RMStrategyArgs)
    data: PreferenceDataArgs = field(default_factory=PreferenceDataArgs)
    vision: VisionArgs = field(default_factory=VisionArgs)
    pairs: PairDataArgs = field(default_factory=PairDataArgs)
    train: RMTrainArgs = field(default_factory=RMTrainArgs)
    logging: LoggingArgs = field(default_factory=LoggingArgs)
    checkpoint: CheckpointArgs = field(default_factory=CheckpointArgs)
    plan: DryRunArgs = field(default_factory=DryRunArgs)

    def validate(self) -> None:
        """Every flag rule (UserError, one line): the sections' own, then the ones that join sections."""
        validate_sections(self)
        check_token_budget(self.strategy, 2 * self.data.max_len, "2 x --max_len: a chosen and a rejected row")
        if self.model.load_in_4bit:
            raise UserError("--load_in_4bit is not supported by train_rm yet (QLoRA covers causal-LM training: "
                            "train_sft, train_dpo, train_kto and the RL actor); drop it")
        if self.model.use_liger_kernel:
            raise UserError("--use_liger_kernel patches the trained causal LM (train_sft, train_dpo, train_kto and "
                            "the RL actor); train_rm trains a value model: drop it")
        check_ring_combinations(self.strategy, 0.0)
        check_vision_flags(self.vision, self.strategy.ring_attn_size)

    def inert_flags(self) -> dict[str, str]:
        """Flags given that cannot act with the others (`rlhfkit.config.base.refuse_inert_flags`)."""
        return vision_inert_flags(self.vision)

    def check_inputs(self) -> None:
        """What the run needs besides valid flags (the trainer calls it before reading anything)."""
        _require_dataset(self.data, "preference pairs")
        check_output_paths(self)


@dataclass
class DPOConfig:
    model: ModelArgs = field(default_factory=ModelArgs)
    reference: ReferenceArgs = field(default_factory=ReferenceArgs)
    strategy: DPOStrategyArgs = field(default_factory=DPOStrategyArgs)
    data: DPODataArgs = field(default_factory=DPODataArgs)
    vision: VisionArgs = field(default_factory=VisionArgs)
    pairs: PairDataArgs = field(default_factory=PairDataArgs)
    train: DPOTrainArgs = field(default_factory=DPOTrainArgs)
    logging: LoggingArgs = field(default_factory=LoggingArgs)
    checkpoint: CheckpointArgs = field(default_factory=CheckpointArgs)
    plan: DryRunArgs = field(default_factory=DryRunArgs)

    def validate(self) -> None:
        """Every flag rule (UserError, one line): the sections' own, then the ones that join sections."""
        validate_sections(self)
        check_token_budget(self.strategy, 2 * self.data.max_len, "2 x --max_len: a chosen and a rejected row")
        check_aux_loss_flags(self.train.aux_loss_coef, self.data.packing_samples)
        check_ring_combinations(self.strategy, self.train.aux_loss_coef)
        check_vision_flags(self.vision, self.strategy.ring_attn_size)
        if self.pairs.margin_key:
            raise UserError("--margin_key applies to train_rm only; DPO has no reward margin")
        if self.train.loss_type in REFERENCE_FREE_DPO_LOSSES and (self.reference.ref_pretrain or
                                                                  self.reference.ref_offload):
            raise UserError(f"--loss_type {self.train.loss_type} is reference-free and loads no reference model; "
                            "drop --ref_pretrain / --ref_offload")

    def inert_flags(self) -> dict[str, str]:
        """Flags given that cannot act with the others (`rlhfkit.config.base.refuse_inert_flags`)."""
        return vision_inert_flags(self.vision)

    def check_inputs(self) -> None:
        """What the run needs besides valid flags (the trainer calls it before reading anything)."""
        _require_dataset(self.data, "preference pairs")
        check_output_paths(self)


@dataclass
class KTOConfig:
    model: ModelArgs = field(default_factory=ModelArgs)
    reference: ReferenceArgs = field(default_factory=ReferenceArgs)
    strategy: DPOStrategyArgs = field(default_factory=DPOStrategyArgs)
    data: DPODataArgs = field(default_factory=DPODataArgs)
    vision: VisionArgs = field(default_factory=VisionArgs)
    unpaired: UnpairedDataArgs = field(default_factory=UnpairedDataArgs)
    train: KTOTrainArgs = field(default_factory=KTOTrainArgs)
    logging: LoggingArgs = field(default_factory=LoggingArgs)
    checkpoint: CheckpointArgs = field(default_factory=CheckpointArgs)
    plan: DryRunArgs = field(default_factory=DryRunArgs)

    def validate(self) -> None:
        """Every flag rule (UserError, one line): the sections' own, then the ones that join sections."""
        validate_sections(self)
        if self.strategy.use_dynamic_batch:
            raise UserError("--use_dynamic_batch is not supported by train_kto yet: KTO's KL reference point is "
                            "estimated within each micro-batch, so a token-budget split would change the loss; use "
                            "--micro_train_batch_size")
        if self.strategy.micro_train_batch_size < 2:
            raise UserError("KTO needs --micro_train_batch_size >= 2: its KL reference point pairs each prompt with "
                            "another sample's completion from the same micro batch")
        refuse_ring_attn(self.strategy, "train_kto")
        check_aux_loss_flags(self.train.aux_loss_coef, self.data.packing_samples)
        check_vision_flags(self.vision, self.strategy.ring_attn_size)

    def inert_flags(self) -> dict[str, str]:
        """Flags given that cannot act with the others (`rlhfkit.config.base.refuse_inert_flags`)."""
        return vision_inert_flags(self.vision)

    def check_inputs(self) -> None:
        """What the run needs besides valid flags (the trainer calls it before reading anything)."""
        _require_dataset(self.data, "unpaired completions with labels")
        check_output_paths(self)


@dataclass
class ServeRMConfig:
    reward_pretrain: str | None = arg(None, "Reward model directory (written by train_rm).")
    host: str = arg("127.0.0.1", "Address to bind. The default serves this machine only; 0.0.0.0 exposes the "
                                 "server to the network (set --api_key then).")
    port: int = arg(5000, "TCP port (0: pick a free one).")
    api_key: str | None = arg(None, "Require `Authorization: Bearer <key>` (default: env RLHFKIT_RM_API_KEY; an "
                                    "empty value never overrides a set environment key). Without a key the server "
                                    "refuses to start unless --no_auth is given.")
    no_auth: bool = arg(False, "Serve without a bearer token (prints a warning): anyone who can reach the port can "
                               "use the model. Refused together with a key.")
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
    max_concurrent_bodies: int = arg(4, "Most request bodies read and parsed at once (others wait): bounds the "
                                        "memory of bodies to about this times --max_body_bytes.")
    max_connections: int = arg(512, "Most open connections and requests at once; past it, requests get 503.")
    keep_alive_timeout: float = arg(5.0, "Seconds an idle connection (before its first request or between "
                                         "requests) stays open.")
    bf16: bool = arg(False, "Run the reward model in bfloat16. Not given: bf16 on a CUDA GPU (OpenRLHF's default), "
                            "fp32 on CPU; --param_dtype fp32 keeps fp32 on a GPU.")
    attn_implementation: str = arg(AUTO, ATTN_HELP, choices=ATTN_CHOICES)
    flash_attn: bool = arg(False, "Use flash_attention_2.")
    disable_fast_tokenizer: bool = arg(False, "Load the slow (Python) tokenizer.")

    def validate(self) -> None:
        """Fail fast, before the model loads, on settings the server cannot run with."""
        if not 0 <= self.port <= 65535:
            raise UserError(f"--port {self.port} is not a TCP port; use 1-65535 (or 0 to pick a free one)")
        if self.max_len < 2:
            raise UserError(f"--max_len must be at least 2 (got {self.max_len})")
        for flag in ("batch_size", "max_body_bytes", "max_queries_per_request", "max_concurrent_bodies",
                     "max_connections"):
            if getattr(self, flag) < 1:
                raise UserError(f"--{flag} must be at least 1 (got {getattr(self, flag)})")
        for flag in ("request_timeout", "client_timeout", "keep_alive_timeout"):
            if not getattr(self, flag) > 0:
                raise UserError(f"--{flag} must be a positive number of seconds (got {getattr(self, flag)})")
        if self.batch_wait_ms < 0:
            raise UserError(f"--batch_wait_ms must be >= 0 (got {self.batch_wait_ms})")
        if self.flash_attn and self.attn_implementation == "eager":
            raise UserError("--flash_attn asks for flash_attention_2 but --attn_implementation is eager; pass one")

    def check_inputs(self) -> None:
        if not self.reward_pretrain:
            raise UserError("--reward_pretrain is required: the reward model directory written by train_rm")
        self.resolved_api_key()

    def resolved_api_key(self) -> str | None:
        """The bearer token to require, or None with --no_auth. An empty --api_key falls back to the environment,
        so a script passing an unset variable never exposes the model; only --no_auth turns auth off."""
        return server_api_key("serve_rm", self.api_key, self.no_auth, SERVE_RM_KEY_ENV, need_key=True)


def _require_dataset(data: DataArgs, what: str) -> None:
    if not data.dataset:
        raise UserError(f"--dataset is required: {what} as a local json/jsonl/parquet/csv/arrow file or dataset "
                        "directory")
