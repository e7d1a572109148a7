"""The RL run doctor: alarms, each with one line of advice, read off the metrics an RL step already logs.

Pure bookkeeping on floats: `Doctor.observe(step, metrics)` takes one RL step's metrics (the trainer's dict, keys
without the `train/` prefix) and `Doctor.observe_eval(step, metrics)` one evaluation's; each returns the alarms that
start at that step. The state is small: each watched metric's value at the first step it was logged (its start) and
its last `--doctor_window` values (a moving average, so one noisy step does not fire an alarm). An alarm is reported
once when its condition starts to hold, and again only after it has cleared (its condition false for a whole
window): a run that stays sick says so once.

The trainer (rlhfkit/rl/trainer.py) prints each alarm, logs it to metrics.jsonl as a `doctor` record
(`{"step": 7, "doctor/entropy_collapse": 0.31}`, the measured value), and the HTML run report lists them with
their advice (`alarms_in`). The thresholds are the `--doctor_*` flags (`DoctorArgs`); docs/doctor.md explains each.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rlhfkit.config.rl_sections import DoctorArgs

PREFIX = "doctor"  # the metrics.jsonl prefix of alarm records
HELDOUT_KEY = "pass@1"  # the held-out metric of the reward-hacking hint (RLTrainer.evaluate logs it)

# alarm name -> (title, advice): the one line of advice printed and shown in the report
ALARMS: dict[str, tuple[str, str]] = {
    "entropy_collapse": (
        "entropy collapse",
        "the policy has become near-deterministic and stops exploring: lower --actor_learning_rate, raise "
        "--init_kl_coef, or add --entropy_loss_coef (e.g. 1e-3)"),
    "kl_blowup": (
        "KL blow-up",
        "the policy has moved far from the reference: lower --actor_learning_rate, raise --init_kl_coef or set "
        "--kl_target, and check the reward for an exploit"),
    "clip_fraction_high": (
        "clip fraction high",
        "updates move the policy too far per optimizer step: lower --actor_learning_rate or --max_epochs, or raise "
        "--train_batch_size"),
    "clip_fraction_low": (
        "clip fraction low",
        "updates barely move the policy: raise --actor_learning_rate, or lower the doctor's floor if one optimizer "
        "step per rollout is intended"),
    "length_runaway": (
        "response length running away",
        "responses grow without bound (often rewarded verbosity or repetition): check the reward, add "
        "--overlong_buffer_len or --stop_properly_penalty_coef, lower --actor_learning_rate"),
    "length_collapse": (
        "response length collapsing",
        "responses shrink towards nothing (often a length-penalising reward or KL): check the reward and the KL "
        "settings, lower --actor_learning_rate"),
    "equal_reward_groups": (
        "all-equal reward groups",
        "most prompts give every sample the same reward, so GRPO-style advantages are zero and nothing is learned: "
        "use prompts of fitting difficulty, --dynamic_filtering, more --n_samples_per_prompt or a graded reward"),
    "logprob_gap": (
        "rollout/trainer log-prob gap",
        "the rollout engine samples from another distribution than the trainer scores: check the weight sync and "
        "the engine's dtype, or correct it with --enable_vllm_is_correction"),
    "reward_hacking": (
        "reward hacking hint",
        "the training reward rises while the held-out metric falls: the policy may exploit the reward; inspect "
        "samples, harden the reward, raise --init_kl_coef, keep the best checkpoint (--best_metric_key)"),
}


@dataclass(frozen=True)
class Alarm:
    """One alarm at one step: `value` is the measured quantity, `detail` says how it compares with its threshold."""

    name: str
    step: int
    value: float
    detail: str

    @property
    def advice(self) -> str:
        return ALARMS[self.name][1]

    def line(self) -> str:
        """The console line."""
        return f"doctor: step {self.step}: {ALARMS[self.name][0]}: {self.detail}. Advice: {self.advice}"


class Watched:
    """One metric's start (its first finite value) and its last `window` finite values."""

    def __init__(self, window: int):
        self.start: float | None = None
        self.recent: deque[float] = deque(maxlen=window)

    def add(self, value: float) -> None:
        if not math.isfinite(value):
            return  # non-finite steps are the non-finite guard's business (--max_nonfinite_skips)
        if self.start is None:
            self.start = value
        self.recent.append(value)

    def mean(self) -> float:
        return sum(self.recent) / len(self.recent)


# metric keys (the trainer's, without train/) the step alarms read
WATCHED = ("actor/entropy", "kl", "actor/clip_fraction", "response_length", "truncated", "reward_groups_all_equal",
           "rollout_logprob_diff", "reward")


class Doctor:
    """The alarms of one run, with the thresholds of `args`."""

    def __init__(self, args: DoctorArgs):
        self.args = args
        self.series = {key: Watched(args.doctor_window) for key in WATCHED}
        self.active: dict[str, int] = {}  # alarm -> observations since its condition last held
        self.best_eval: tuple[float, float] | None = None  # (held-out value, training reward mean then)

    def observe(self, step: int, metrics: dict[str, float]) -> list[Alarm]:
        """Take RL step `step`'s metrics; the alarms that start at this step."""
        for key, watched in self.series.items():
            if key in metrics:
                watched.add(float(metrics[key]))
        found = {}
        for check in (self._entropy, self._kl, self._clip_fraction, self._length, self._equal_groups, self._gap):
            result = check()
            if result is not None:
                found[result[0]] = Alarm(result[0], step, result[1], result[2])
        return self._onsets(found, judged=set(ALARMS) - {"reward_hacking"})

    def observe_eval(self, step: int, metrics: dict[str, float]) -> list[Alarm]:
        """Take an evaluation's metrics (keys without eval/); a reward-hacking alarm when it starts here."""
        value, reward = metrics.get(HELDOUT_KEY), self.series["reward"]
        if value is None or not math.isfinite(value) or not reward.recent:
            return []
        found = {}
        if self.best_eval is None or value > self.best_eval[0]:
            self.best_eval = (value, reward.mean())
        elif value < self.best_eval[0] - self.args.doctor_heldout_drop and reward.mean() > self.best_eval[1]:
            found["reward_hacking"] = Alarm(
                "reward_hacking", step, value,
                f"held-out {HELDOUT_KEY} {value:.3g} is {self.best_eval[0] - value:.3g} below its best "
                f"{self.best_eval[0]:.3g} (--doctor_heldout_drop {self.args.doctor_heldout_drop:g}) while the "
                f"training reward rose from {self.best_eval[1]:.3g} to {reward.mean():.3g}")
        return self._onsets(found, judged={"reward_hacking"})

    def _onsets(self, found: dict[str, Alarm], judged: set[str]) -> list[Alarm]:
        """The alarms of `found` not already active. An active alarm of `judged` (what this observation checks)
        clears once its condition has not held for `--doctor_window` observations in a row, so a metric hovering
        at its threshold does not fire again and again."""
        onsets = [alarm for name, alarm in found.items() if name not in self.active]
        for name in judged:
            if name in found:
                self.active[name] = 0
            elif name in self.active:
                self.active[name] += 1
                if self.active[name] >= self.args.doctor_window:
                    del self.active[name]
        return onsets

    # -- the step checks: (name, value, detail) or None ------------------------------------------------------
    def _ready(self, key: str) -> Watched | None:
        watched = self.series[key]
        return watched if watched.recent else None

    def _entropy(self) -> tuple[str, float, str] | None:
        w, ratio = self._ready("actor/entropy"), self.args.doctor_entropy_ratio
        if w is None or w.start is None or w.start <= 0 or w.mean() >= ratio * w.start:
            return None
        return "entropy_collapse", w.mean(), (f"mean token entropy {w.mean():.3g} is below {ratio:g} x its start "
                                              f"{w.start:.3g} (--doctor_entropy_ratio)")

    def _kl(self) -> tuple[str, float, str] | None:
        return _above(self._ready("kl"), self.args.doctor_kl_max, "kl_blowup", "KL to the reference",
                      "--doctor_kl_max")

    def _clip_fraction(self) -> tuple[str, float, str] | None:
        w = self._ready("actor/clip_fraction")
        lo, hi = self.args.doctor_clip_fraction_range
        if w is None or lo <= w.mean() <= hi:
            return None
        name = "clip_fraction_high" if w.mean() > hi else "clip_fraction_low"
        return name, w.mean(), (f"clip fraction {w.mean():.3g} is outside [{lo:g}, {hi:g}] "
                                "(--doctor_clip_fraction_range)")

    def _length(self) -> tuple[str, float, str] | None:
        w, cut = self._ready("response_length"), self._ready("truncated")
        lo, hi = self.args.doctor_length_range
        limit = self.args.doctor_truncated_max
        if cut is not None and cut.start is not None and cut.start <= limit < cut.mean():
            # --generate_max_len caps the length, so a runaway shows as more and more responses cut off there
            return "length_runaway", cut.mean(), (f"share of responses cut at --generate_max_len {cut.mean():.3g} "
                                                  f"rose above {limit:g} from {cut.start:.3g} (--doctor_truncated_max)")
        if w is None or w.start is None or w.start <= 0 or lo <= w.mean() / w.start <= hi:
            return None
        name = "length_runaway" if w.mean() / w.start > hi else "length_collapse"
        return name, w.mean(), (f"mean response length {w.mean():.4g} is {w.mean() / w.start:.3g} x its start "
                                f"{w.start:.4g}, outside [{lo:g}, {hi:g}] (--doctor_length_range)")

    def _equal_groups(self) -> tuple[str, float, str] | None:
        return _above(self._ready("reward_groups_all_equal"), self.args.doctor_equal_reward_groups_max,
                      "equal_reward_groups", "share of prompts whose samples all got one reward",
                      "--doctor_equal_reward_groups_max")

    def _gap(self) -> tuple[str, float, str] | None:
        return _above(self._ready("rollout_logprob_diff"), self.args.doctor_logprob_gap_max, "logprob_gap",
                      "mean absolute rollout/trainer log-prob gap", "--doctor_logprob_gap_max")


def _above(w: Watched | None, limit: float, name: str, what: str, flag: str) -> tuple[str, float, str] | None:
    if w is None or w.mean() <= limit:
        return None
    return name, w.mean(), f"{what} {w.mean():.3g} is above {limit:g} ({flag})"


def make_doctor(args: DoctorArgs) -> Doctor | None:
    """The run's doctor; None with --doctor off."""
    return Doctor(args) if args.doctor == "on" else None


def report_alarms(alarms: list[Alarm], say: Callable[[str], None], log: Callable[..., None]) -> None:
    """Print each alarm's line with `say` and log it as a `doctor` record with `log(step, {name: value},
    prefix="doctor")` (MetricsLogger.log)."""
    for alarm in alarms:
        say(alarm.line())
        log(alarm.step, {alarm.name: alarm.value}, prefix=PREFIX)


def alarms_in(records: list[dict[str, Any]]) -> list[tuple[int, str, float, str]]:
    """(step, title, value, advice) of every alarm record of a metrics.jsonl (its parsed records), for the report."""
    out = []
    for record in records:
        for key, value in record.items():
            name = key.removeprefix(PREFIX + "/")
            if key.startswith(PREFIX + "/") and name in ALARMS:
                out.append((int(record["step"]), ALARMS[name][0], float(value), ALARMS[name][1]))
    return out
