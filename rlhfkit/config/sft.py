"""Config of `rlhfkit.cli.train_sft`."""

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
from rlhfkit.config.paths import check_output_paths
from rlhfkit.config.sequence_parallel import check_ring_combinations
from rlhfkit.config.vision import VisionArgs, check_vision_flags, vision_inert_flags
from rlhfkit.errors import UserError


@dataclass
class SFTDataArgs(DataArgs):
    """OpenRLHF's train_sft puts a plain-text prompt into a template unless told otherwise (docs/migration.md)."""

    input_template: str | None = with_default(DataArgs, "input_template", "User: {}\nAssistant: ")


@dataclass
class SFTTrainArgs:
    max_epochs: int = arg(2, "Passes over the training data.")
    max_steps: int = arg(-1, "Stop after this many optimizer steps (-1: run every epoch); the learning-rate "
                             "schedule still spans the whole run, so a later --load_checkpoint continues it.")
    aux_loss_coef: float = arg(0.0, "Weight of the mixture-of-experts load-balancing loss (MoE models only).")

    def validate(self) -> None:
        check_loop_counts(self.max_epochs, self.max_steps)


@dataclass
class SFTConfig:
    model: ModelArgs = field(default_factory=ModelArgs)
    strategy: StrategyArgs = field(default_factory=StrategyArgs)
    data: SFTDataArgs = field(default_factory=SFTDataArgs)
    vision: VisionArgs = field(default_factory=VisionArgs)
    train: SFTTrainArgs = field(default_factory=SFTTrainArgs)
    logging: LoggingArgs = field(default_factory=LoggingArgs)
    checkpoint: CheckpointArgs = field(default_factory=CheckpointArgs)
    plan: DryRunArgs = field(default_factory=DryRunArgs)

    def validate(self) -> None:
        """Every flag rule (UserError, one line): the sections' own, then the ones that join sections."""
        validate_sections(self)
        check_token_budget(self.strategy, self.data.max_len, "--max_len")
        check_aux_loss_flags(self.train.aux_loss_coef, self.data.packing_samples)
        check_ring_combinations(self.strategy, self.train.aux_loss_coef)
        check_vision_flags(self.vision, self.strategy.ring_attn_size)

    def inert_flags(self) -> dict[str, str]:
        """Flags given that cannot act with the others (`rlhfkit.config.base.refuse_inert_flags`)."""
        return vision_inert_flags(self.vision)

    def check_inputs(self) -> None:
        """What the run needs besides valid flags (the trainer calls it before reading anything)."""
        if not self.data.dataset:
            raise UserError("--dataset is required: a local json/jsonl/parquet/csv/arrow file or dataset directory")
        check_output_paths(self)

