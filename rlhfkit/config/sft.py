"""Config of `rlhfkit.cli.train_sft`."""

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


@dataclass
class SFTTrainArgs:
    max_epochs: int = arg(1, "Passes over the training data.")
    max_steps: int = arg(-1, "Stop after this many optimizer steps (-1: run every epoch); the learning-rate "
                             "schedule still spans the whole run, so a later --load_checkpoint continues it.")
    aux_loss_coef: float = arg(0.0, "Weight of the mixture-of-experts load-balancing loss (MoE models only).")


@dataclass
class SFTConfig:
    model: ModelArgs = field(default_factory=ModelArgs)
    strategy: StrategyArgs = field(default_factory=StrategyArgs)
    data: DataArgs = field(default_factory=DataArgs)
    train: SFTTrainArgs = field(default_factory=SFTTrainArgs)
    logging: LoggingArgs = field(default_factory=LoggingArgs)
    checkpoint: CheckpointArgs = field(default_factory=CheckpointArgs)
    plan: DryRunArgs = field(default_factory=DryRunArgs)


def validate_sft_config(cfg: SFTConfig) -> SFTConfig:
    """Fail fast (UserError, one line) on settings that cannot run; returns the config."""
    validate_dynamic_batch(cfg.strategy, cfg.data.max_len, "--max_len")
    return cfg
