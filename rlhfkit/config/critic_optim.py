"""The critic's own optimizer settings (train_ppo / train_ppo_ray), OpenRLHF 0.11's `--critic.optim`,
`--critic.adam.*`, `--critic.lr_scheduler`, ... Each is None unless given: the critic then uses the actor's value
(the shared flags `--adam_betas`, `--max_norm`, ...), so a command that sets none of them trains the critic as
before. Its learning rate is `--critic_learning_rate` (rlhfkit.config.rl_sections.AlgorithmArgs)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from rlhfkit.config.base import arg
from rlhfkit.config.common import LR_SCHEDULERS, OPTIMIZERS, StrategyArgs, check_optimizer_flags

_ACTORS = " (default: the actor's, {})."


def _help(text: str, shared: str) -> str:
    return text + _ACTORS.format(shared)


@dataclass
class CriticOptimArgs:
    critic_optim: str | None = arg(None, _help("The critic's optimizer, adam or muon", "--optim"),
                                   choices=OPTIMIZERS)
    critic_adam_betas: list[float] | None = arg(None, _help("The critic's AdamW betas", "--adam_betas"))
    critic_adam_eps: float | None = arg(None, _help("The critic's AdamW eps", "--adam_eps"))
    critic_l2: float | None = arg(None, _help("The critic's weight decay", "--l2"))
    critic_lr_scheduler: str | None = arg(None, _help("The critic's learning-rate schedule", "--lr_scheduler"),
                                          choices=LR_SCHEDULERS)
    critic_lr_warmup_ratio: float | None = arg(None, _help("The critic's warmup fraction", "--lr_warmup_ratio"))
    critic_min_lr_ratio: float | None = arg(None, _help("The critic's cosine_with_min_lr floor", "--min_lr_ratio"))
    critic_max_norm: float | None = arg(None, _help("The critic's gradient clipping norm", "--max_norm"))
    critic_muon_lr: float | None = arg(None, _help("The critic's Muon learning rate", "--muon_lr"))
    critic_muon_momentum: float | None = arg(None, _help("The critic's Muon momentum", "--muon_momentum"))
    critic_muon_ns_steps: int | None = arg(None, _help("The critic's Newton-Schulz steps", "--muon_ns_steps"))
    critic_muon_nesterov: bool | None = arg(None, _help("The critic's Muon uses Nesterov momentum (OpenRLHF's "
                                                        "--critic.muon.no_nesterov turns it off)",
                                                        "--muon_nesterov"))


def critic_strategy(actor: StrategyArgs, critic: CriticOptimArgs) -> StrategyArgs:
    """The critic's strategy section: the actor's, with the critic's optimizer settings that were given."""
    c = critic
    own: dict[str, Any] = {"optim": c.critic_optim, "adam_betas": c.critic_adam_betas, "adam_eps": c.critic_adam_eps,
           "l2": c.critic_l2, "lr_scheduler": c.critic_lr_scheduler, "lr_warmup_ratio": c.critic_lr_warmup_ratio,
           "min_lr_ratio": c.critic_min_lr_ratio, "max_norm": c.critic_max_norm, "muon_lr": c.critic_muon_lr,
           "muon_momentum": c.critic_muon_momentum, "muon_ns_steps": c.critic_muon_ns_steps,
           "muon_nesterov": c.critic_muon_nesterov}
    return dataclasses.replace(actor, **{k: v for k, v in own.items() if v is not None})


def check_critic_optimizer(actor: StrategyArgs, critic: CriticOptimArgs) -> None:
    """The optimizer rules on the critic's effective settings, named with the critic's flags."""
    check_optimizer_flags(critic_strategy(actor, critic), prefix="critic_")
