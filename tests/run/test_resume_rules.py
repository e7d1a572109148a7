"""The resume rule table (`rlhfkit.run.resume_rules`) on saved/new config dicts, the one-line errors it gives through
`check_compatible` and for all-damaged checkpoints, and the metrics file a resumed run keeps (one row per step)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlhfkit.errors import UserError
from rlhfkit.logging.metrics import records_through
from rlhfkit.run.resume_rules import plan_resume

SAVED = {"model": {"pretrain": "/m", "bf16": False, "lora_rank": 0},
         "strategy": {"zero_stage": 2, "train_batch_size": 8, "learning_rate": 1e-3, "optim": "adam"},
         "algo": {"advantage_estimator": "group_norm"}, "save": {"enable_ema": False},
         "checkpoint": {"load_checkpoint": False, "use_ds_universal_ckpt": False}}


def changed(**flags):
    """SAVED with `section__field=value` changes."""
    out = {k: dict(v) for k, v in SAVED.items()}
    for key, value in flags.items():
        section, name = key.split("__")
        out[section][name] = value
    return out


def test_an_unchanged_config_and_the_resume_flags_themselves_say_nothing():
    plan = plan_resume(SAVED, changed(checkpoint__load_checkpoint=True), universal=False)
    assert (plan.refused, plan.converted, plan.warned) == ([], [], [])


def test_harmless_changes_resume_with_a_warning_naming_each_flag():
    plan = plan_resume(SAVED, changed(strategy__learning_rate=5e-4, checkpoint__use_ds_universal_ckpt=True),
                       universal=False)
    assert plan.refused == [] and plan.converted == []
    assert plan.warned == ["--use_ds_universal_ckpt False -> True", "--learning_rate 0.001 -> 0.0005"]


@pytest.mark.parametrize(("flags", "named"), [
    ({"strategy__zero_stage": 3}, "--zero_stage 2 -> 3: a DeepSpeed checkpoint loads only at the ZeRO stage it "
                                  "was saved with (resume with --zero_stage 2, or save with --use_ds_universal_ckpt"),
    ({"model__bf16": True}, "--bf16 False -> True: a DeepSpeed checkpoint loads only at the precision it was saved "
                            "with (resume without --bf16, "),
    ({"algo__advantage_estimator": "gae"}, "--advantage_estimator gae trains a critic and this checkpoint "
                                           "(group_norm) has none"),
    ({"save__enable_ema": True}, "--enable_ema: the checkpoint holds no EMA weights"),
    ({"strategy__optim": "muon"}, "--optim 'adam' -> 'muon'"),
    ({"model__pretrain": "/other"}, "--pretrain '/m' -> '/other': the checkpoint holds another model's weights"),
    ({"model__lora_rank": 8}, "--lora_rank 0 -> 8"),
    ({"strategy__train_batch_size": 16}, "--train_batch_size 8 -> 16"),
])
def test_refused_changes_name_their_flag(flags, named):
    plan = plan_resume(SAVED, changed(**flags), universal=False)
    assert len(plan.refused) == 1 and named in plan.refused[0], plan.refused
    assert plan.warned == []


def test_a_universal_checkpoint_converts_the_layout_but_refuses_the_rest():
    plan = plan_resume(SAVED, changed(strategy__zero_stage=3, model__bf16=True), universal=True)
    assert plan.refused == []
    assert plan.converted == ["--bf16 False -> True: the universal checkpoint loads at any precision",
                              "--zero_stage 2 -> 3: the universal checkpoint loads at any ZeRO stage"]
    plan = plan_resume(SAVED, changed(strategy__zero_stage=0, model__bf16=True), universal=True)
    assert plan.refused == [] and len(plan.converted) == 2  # bf16 at ZeRO-0 too (its fp32 master copy is read)
    plan = plan_resume(SAVED, changed(algo__advantage_estimator="gae"), universal=True)
    assert len(plan.refused) == 1 and "--advantage_estimator" in plan.refused[0]


def test_dropping_a_critic_or_ema_resumes_and_one_model_path_spelled_twice_is_the_same(tmp_path):
    (tmp_path / "m").mkdir()
    saved = changed(algo__advantage_estimator="gae", save__enable_ema=True, model__pretrain=str(tmp_path / "m"))
    plan = plan_resume(saved, changed(model__pretrain=f"{tmp_path}/./m"), universal=False)
    assert plan.refused == [] and plan.warned == ["--advantage_estimator 'gae' -> 'group_norm'",
                                                  "--enable_ema True -> False"]


def checkpoint(root: Path, step: int, config: dict, files: dict[str, bytes]) -> Path:
    """A checkpoint directory as `save_checkpoint` leaves it, with `files` (relative path -> content)."""
    from rlhfkit.run.runs import RunInfo, write_meta

    path = root / f"global_step{step}"
    for rel, data in files.items():
        (path / rel).parent.mkdir(parents=True, exist_ok=True)
        (path / rel).write_bytes(data)
    (path / "state.json").write_text(json.dumps({"global_step": step}))
    write_meta(path, RunInfo("sft", config), step)
    (root / "latest").write_text(path.name)
    return path


def test_check_compatible_refuses_in_one_line_or_converts_a_universal_checkpoint(tmp_path):
    from rlhfkit.run.runs import RunInfo, check_compatible

    plain = checkpoint(tmp_path / "a", 1, SAVED, {"model/zero_pp_rank_0_mp_rank_00_optim_states.pt": b"x"})
    with pytest.raises(UserError) as e:
        check_compatible(plain, RunInfo("sft", changed(strategy__zero_stage=3, model__bf16=True)))
    assert "\n" not in str(e.value) and "--zero_stage 2 -> 3" in str(e.value) and "--bf16 False -> True" in str(e.value)
    universal = checkpoint(tmp_path / "b", 1, SAVED, {"model/universal_state.pt": b"x"})
    notes = check_compatible(universal, RunInfo("sft", changed(strategy__zero_stage=3)))
    assert notes == ["converting: --zero_stage 2 -> 3: the universal checkpoint loads at any ZeRO stage"]


def test_every_checkpoint_damaged_is_one_line_before_any_model_loads(tmp_path):
    from rlhfkit.run.checkpoint import latest_checkpoint

    assert latest_checkpoint(str(tmp_path)) is None  # nothing there: a fresh start
    for step in (1, 2):
        checkpoint(tmp_path, step, SAVED, {"model/w.pt": b"0123456789"})
        (tmp_path / f"global_step{step}" / "model" / "w.pt").write_bytes(b"01")
    with pytest.raises(UserError, match=r"none of the 2 checkpoint\(s\) in .* can be resumed \(global_step2: "
                                        r"model/w.pt is truncated \(2 of 10 bytes\); global_step1: ") as e:
        latest_checkpoint(str(tmp_path))
    assert "\n" not in str(e.value)


def test_a_resumed_run_keeps_each_step_once_in_its_metrics():
    """Killed after logging step 3 (and half of step 4's line) with the checkpoint of step 2: resuming at step 2 drops
    the rows of steps 3 and 4 (trained again) and keeps step 2's eval row and lines without a step."""
    rows = [{"step": 1, "train/loss": 1.0}, {"step": 2, "train/loss": 0.9}, {"step": 2, "eval/loss": 0.8},
            {"note": "no step"}, {"step": 3, "train/loss": 0.7}]
    lines = [json.dumps(r) + "\n" for r in rows] + ['{"step": 4, "train/lo']
    assert records_through(lines, 2) == lines[:4]
    assert records_through(lines[:2], 2) == lines[:2]


def test_the_logger_rewrites_its_files_on_resume(tmp_path):
    from rlhfkit.config.common import LoggingArgs
    from rlhfkit.logging.metrics import MetricsLogger

    logger = MetricsLogger(LoggingArgs(), str(tmp_path), "run", {})
    for step in (1, 2, 3):
        logger.log(step, {"loss": float(step)})
        logger.log_samples(step, [{"prompt": "p"}])
    logger.resumed_at(2)
    logger.log(3, {"loss": 3.5})
    logger._file.close()  # type: ignore[union-attr]  # close() would also render the HTML report
    steps = [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]
    assert json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])["train/loss"] == 3.5
    assert [json.loads(x)["step"] for x in (tmp_path / "samples.jsonl").read_text().splitlines()] == [1, 2]


def test_every_key_of_the_table_is_a_real_config_field():
    """A renamed field would silently turn a refusal into a warning: each key names a field of SFTConfig or
    PPOConfig."""
    import dataclasses

    from rlhfkit.config.rl import PPOConfig
    from rlhfkit.config.sft import SFTConfig
    from rlhfkit.run.resume_rules import LAYOUT, REFUSED, SILENT, TRANSITIONS, flat

    fields = set(flat(dataclasses.asdict(SFTConfig()))) | set(flat(dataclasses.asdict(PPOConfig())))
    table = {*REFUSED, *LAYOUT, *SILENT, *TRANSITIONS}
    assert table - fields == set()
