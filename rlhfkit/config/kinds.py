"""The trainers' configs as one type, for the code that takes any of them: the memory planner and the CLI entry.

A union rather than a Protocol: the planner reads different sections per trainer (the reference of DPO and KTO,
the roles and engines of RL) and narrows with `isinstance`, so the type checker follows each branch."""

from __future__ import annotations

from rlhfkit.config.preference import DPOConfig, KTOConfig, RMConfig
from rlhfkit.config.rl import PPOConfig
from rlhfkit.config.sft import SFTConfig

OfflineConfig = SFTConfig | RMConfig | DPOConfig | KTOConfig
TrainConfig = OfflineConfig | PPOConfig
WithReference = DPOConfig | KTOConfig
