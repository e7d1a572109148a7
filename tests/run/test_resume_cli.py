"""Resume through train_sft's CLI (in this process, a world of one) on the tiny model: a changed --zero_stage or
--bf16 against a DeepSpeed checkpoint is one line, exit 2, before the model loads; a resumed run's metrics file has
each step once; checkpoints that are all damaged are one line, exit 2."""

from __future__ import annotations

import json
from pathlib import Path

from tests.helpers import error_lines

TEMPLATE = "User: {}\nAssistant: "


def cli(capsys, argv: list[str]) -> tuple[int, str, str]:
    from rlhfkit.cli import train_sft
    from rlhfkit.cli.common import run_cli

    capsys.readouterr()
    code = run_cli(train_sft.main, argv, prog="train_sft")
    out, err = capsys.readouterr()
    return code, out, err


def steps(metrics: Path) -> list[int]:
    """The step of every train row of the raw file, in order (no de-duplication on reading)."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    return [r["step"] for r in rows if "train/loss" in r]


def test_resume_refuses_layout_changes_before_loading_and_keeps_one_metrics_row_per_step(
        demo_assets, tmp_path, world_of_one, capsys, monkeypatch):
    save, ckpt = tmp_path / "run", tmp_path / "ckpt"
    args = ["--pretrain", str(demo_assets.model_dir), "--dataset", str(demo_assets.sft_train), "--max_samples", "32",
            "--input_key", "question", "--output_key", "response", "--input_template", TEMPLATE, "--max_len", "40",
            "--train_batch_size", "8", "--micro_train_batch_size", "4", "--zero_stage", "0", "--save_path",
            str(save), "--ckpt_path", str(ckpt), "--save_steps", "2", "--disable_progress_bar"]
    # Step 3 is logged but not checkpointed, as when a SIGKILL lands between its log and the next save.
    code, _, err = cli(capsys, [*args, "--max_steps", "3"])
    assert code == 0, err
    assert steps(save / "metrics.jsonl") == [1, 2, 3]

    import rlhfkit.run.setup as setup

    def no_model(*_a, **_k):
        raise AssertionError("the model loaded before the refusal")

    with monkeypatch.context() as m:
        m.setattr(setup, "load_trainable_lm", no_model)
        for flags, named in [(["--zero_stage", "1"], "--zero_stage 0 -> 1: a DeepSpeed checkpoint loads only at the "
                                                     "ZeRO stage it was saved with (resume with --zero_stage 0"),
                             (["--bf16"], "--bf16 False -> True: a DeepSpeed checkpoint loads only at the precision")]:
            code, _, err = cli(capsys, [*args, *flags, "--max_steps", "4", "--load_checkpoint"])
            assert code == 2 and len(error_lines(err)) == 1 and named in err, err

    code, out, err = cli(capsys, [*args, "--max_steps", "4", "--load_checkpoint"])
    assert code == 0 and f"resumed from {ckpt / 'global_step2'} at step 2" in out, err
    assert steps(save / "metrics.jsonl") == [1, 2, 3, 4]  # the first run's step 3 row was replaced

    for d in ckpt.glob("global_step*"):
        weights = max(d.rglob("*.pt"), key=lambda f: f.stat().st_size)
        weights.write_bytes(weights.read_bytes()[:10])
    code, _, err = cli(capsys, [*args, "--max_steps", "4", "--load_checkpoint"])
    assert code == 2 and len(error_lines(err)) == 1, err
    assert "none of the 2 checkpoint(s)" in err and "global_step4: " in err and "is truncated" in err



def test_a_universal_checkpoint_resumes_in_bf16_and_saves_there_at_zero_stage_0(demo_assets, tmp_path, world_of_one,
                                                                                capsys):
    """fp32 -> --bf16 --zero_stage 0 is converted through --use_ds_universal_ckpt: step 3 trained again from the
    step-2 checkpoint in bf16 gives the loss the fp32 run gave it, to bf16's precision. The bf16 ZeRO-0 run then
    saves (it failed there with KeyError: 'exp_avg': its Adam state is keyed by DeepSpeed's fp32 master copies),
    and an fp32 run resumes that save."""
    save, ckpt = tmp_path / "run", tmp_path / "ckpt"
    args = ["--pretrain", str(demo_assets.model_dir), "--dataset", str(demo_assets.sft_train), "--max_samples", "32",
            "--input_key", "question", "--output_key", "response", "--input_template", TEMPLATE, "--max_len", "40",
            "--train_batch_size", "8", "--micro_train_batch_size", "4", "--zero_stage", "1", "--save_path",
            str(save), "--ckpt_path", str(ckpt), "--save_steps", "2", "--disable_progress_bar",
            "--use_ds_universal_ckpt"]
    code, _, err = cli(capsys, [*args, "--max_steps", "3"])
    assert code == 0, err
    fp32 = json.loads((save / "metrics.jsonl").read_text().splitlines()[-1])["train/loss"]
    code, out, err = cli(capsys, [*args, "--bf16", "--zero_stage", "0", "--max_steps", "4", "--load_checkpoint"])
    assert code == 0 and "converting: --bf16 False -> True: the universal checkpoint loads at any precision" in out, err
    rows = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "train/loss" in r] == [1, 2, 3, 4]
    assert abs(rows[2]["train/loss"] - fp32) <= 0.02 * abs(fp32)
    assert (ckpt / "global_step4" / "model" / "universal_state.pt").is_file()
    code, out, err = cli(capsys, [*args, "--max_steps", "5", "--load_checkpoint"])
    assert code == 0 and f"resumed from {ckpt / 'global_step4'} at step 4" in out, err
