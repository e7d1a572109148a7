"""What a resume may change: the one table of rules for a config that differs from its checkpoint's.

Every key whose value differs between the config saved in a checkpoint (`rlhfkit_ckpt.json`) and the command that
resumes it falls in exactly one class:

- refused: the checkpoint is the wrong starting point (another model, LoRA setting, optimizer, or batch arithmetic
  that changes what a step and the saved data position mean), or it lacks state the new command needs (a critic, EMA
  weights). The run stops with one line naming the flag, before any model loads.
- converted: the engine layout (`--zero_stage`, `--bf16`) changed and the checkpoint is universal
  (`--use_ds_universal_ckpt`: each rank's part of the fp32 weights and Adam moments, by parameter name and element
  range: `rlhfkit.distributed.universal`), which loads into any layout and world size. A DeepSpeed checkpoint loads
  only into the layout it was saved with, so the same change is refused for it.
- silent: differs by construction between a run and its resume (`--load_checkpoint`, `--overwrite_ckpt`).
- resumable: everything else (logging and save cadence, paths, learning rate, ...), with a warning.

Pure: config dicts in (nested as `dataclasses.asdict` gives them, or flat "section.field" keys), a `ResumePlan` out;
`rlhfkit.run.runs.check_compatible` feeds it the checkpoint's saved config and whether its manifest shows the
universal form, and raises the refusals as one line.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# key -> why a change of it makes the checkpoint the wrong starting point
REFUSED = {
    "model.pretrain": "the checkpoint holds another model's weights",
    "model.lora_rank": "the checkpoint's trainable weights are of another LoRA rank",
    "strategy.train_batch_size": "a step and the saved data position mean other samples",
    "rollout.rollout_batch_size": "a step and the saved data position mean other prompts",
    "rollout.n_samples_per_prompt": "a step means other samples",
    "rl_model.critic_pretrain": "the checkpoint holds another critic",
    "strategy.optim": "the saved optimizer state belongs to the other optimizer",
    "critic_optim.critic_optim": "the saved critic optimizer state belongs to the other optimizer",
}
# Engine layout: a DeepSpeed checkpoint loads only into the layout it was saved with, a universal one into any.
LAYOUT = {
    "strategy.zero_stage": "ZeRO stage",
    "model.bf16": "precision",
}
# What differs between a run and its resume by construction: no warning.
SILENT = ("checkpoint.load_checkpoint", "checkpoint.overwrite_ckpt")


def _adds_critic(saved: Any, now: Any) -> str | None:
    if now == "gae" and saved is not None and saved != "gae":
        return (f"--advantage_estimator {now} trains a critic and this checkpoint ({saved}) has none; resume with "
                f"--advantage_estimator {saved}")
    return None


def _adds_ema(saved: Any, now: Any) -> str | None:
    if now and not saved:
        return "--enable_ema: the checkpoint holds no EMA weights; resume without --enable_ema"
    return None


# key -> f(saved value, new value): why this particular change is refused, or None when it resumes
TRANSITIONS: dict[str, Callable[[Any, Any], str | None]] = {
    "algo.advantage_estimator": _adds_critic,
    "save.enable_ema": _adds_ema,
}


@dataclass
class ResumePlan:
    """What resuming with the new config means: refusals (each names its flag), conversions and warnings (lines to
    print). Resumable when `refused` is empty."""

    refused: list[str] = field(default_factory=list)
    converted: list[str] = field(default_factory=list)
    warned: list[str] = field(default_factory=list)


def flat(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"section": {"field": v}} -> {"section.field": v}."""
    out: dict[str, Any] = {}
    for k, v in config.items():
        if isinstance(v, dict):
            out.update(flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def same(key: str, a: Any, b: Any) -> bool:
    if a == b:
        return True
    if key.endswith("_pretrain") or key == "model.pretrain":  # one model named by two spellings of its path
        return isinstance(a, str) and isinstance(b, str) and os.path.realpath(a) == os.path.realpath(b)
    return False


def change(key: str, saved: Any, now: Any) -> str:
    """`--flag old -> new`, the flag spelled as users type it."""
    return f"--{key.split('.')[-1]} {saved!r} -> {now!r}"


def setting(key: str, value: Any) -> str:
    """How a command line gives `value` to the flag of `key`: `with --zero_stage 2`, `with --bf16`, `without --bf16`."""
    name = f"--{key.split('.')[-1]}"
    if isinstance(value, bool):
        return f"with {name}" if value else f"without {name}"
    return f"with {name} {value}"


def _layout(key: str, saved: Any, now: Any, universal: bool, plan: ResumePlan) -> None:
    what = LAYOUT[key]
    if universal:
        plan.converted.append(f"{change(key, saved, now)}: the universal checkpoint loads at any {what}")
    else:
        plan.refused.append(f"{change(key, saved, now)}: a DeepSpeed checkpoint loads only at the {what} it was "
                            f"saved with (resume {setting(key, saved)}, or save with --use_ds_universal_ckpt to "
                            "change it)")


def plan_resume(saved: dict[str, Any], now: dict[str, Any], *, universal: bool) -> ResumePlan:
    """Classify every difference between the checkpoint's config `saved` and the new `now` (module docstring);
    `universal`: the checkpoint's engines are in the universal form."""
    saved, now = flat(saved), flat(now)
    plan = ResumePlan()
    for key in sorted(set(saved) | set(now)):
        old, new = saved.get(key), now.get(key)
        if same(key, old, new) or key in SILENT:
            continue
        if key in REFUSED:
            plan.refused.append(f"{change(key, old, new)}: {REFUSED[key]}")
        elif key in LAYOUT:
            _layout(key, old, new, universal, plan)
        elif key in TRANSITIONS and (why := TRANSITIONS[key](old, new)) is not None:
            plan.refused.append(why)
        else:
            plan.warned.append(change(key, old, new))
    return plan
