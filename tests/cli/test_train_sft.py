"""Bad input to train_sft: one clear line on stderr, exit code 2, no traceback."""

from __future__ import annotations

import json

import pytest

from rlhfkit.cli.common import run_cli
from rlhfkit.cli.train_sft import main
from tests.helpers import error_lines, run_module

TEMPLATE = "User: {}\nAssistant: "


def base(assets, data: str, *extra: str) -> list[str]:
    return ["--pretrain", str(assets.model_dir), "--dataset", data, "--input_key", "question",
            "--output_key", "response", "--input_template", TEMPLATE, "--train_batch_size", "4",
            "--micro_train_batch_size", "2", "--max_len", "48", *extra]


def error_line(capsys, argv) -> str:
    code = run_cli(main, argv, prog="train_sft")
    err = error_lines(capsys.readouterr().err)
    assert code == 2, err
    assert len(err) == 1, err
    assert "Traceback" not in err[0]
    return err[0]


def test_missing_dataset_path(capsys, demo_assets, tmp_path):
    line = error_line(capsys, base(demo_assets, str(tmp_path / "nope.jsonl")))
    assert "--dataset" in line and "nope.jsonl" in line


def test_record_without_input_key_names_file_and_record(capsys, demo_assets, tmp_path):
    path = tmp_path / "d.jsonl"
    rows = [{"question": "q1", "response": "a"}, {"question": "q2", "response": "b"}, {"prompt": "x", "response": "c"}]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    line = error_line(capsys, base(demo_assets, str(path)))
    assert "d.jsonl" in line and "3" in line and "question" in line


def test_empty_dataset(capsys, demo_assets, tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("")
    line = error_line(capsys, base(demo_assets, str(path)))
    assert "empty.jsonl" in line and "no records" in line


def test_max_len_too_small(capsys, demo_assets):
    line = error_line(capsys, base(demo_assets, str(demo_assets.sft_train), "--max_len", "3"))
    assert "--max_len" in line


def test_batch_not_divisible(capsys, demo_assets):
    line = error_line(capsys, base(demo_assets, str(demo_assets.sft_train), "--train_batch_size", "10",
                                   "--micro_train_batch_size", "4"))
    assert "--train_batch_size 10" in line and "--micro_train_batch_size 4" in line


def test_unknown_flag(capsys, demo_assets):
    with pytest.raises(SystemExit) as exc:
        main(base(demo_assets, str(demo_assets.sft_train), "--no_such_flag"))
    assert exc.value.code == 2
    err = error_lines(capsys.readouterr().err)
    assert len(err) == 1 and "--no_such_flag" in err[0]


def test_model_path_that_is_not_a_model(capsys, demo_assets, tmp_path):
    argv = base(demo_assets, str(demo_assets.sft_train))
    argv[1] = str(tmp_path)
    line = error_line(capsys, argv)
    assert "--pretrain" in line and "not a model directory" in line


def test_errors_are_one_line_from_a_real_process(demo_assets, tmp_path):
    proc = run_module(["rlhfkit.cli.train_sft", *base(demo_assets, str(tmp_path / "missing.jsonl"))])
    assert proc.returncode == 2
    lines = error_lines(proc.stderr)
    assert len(lines) == 1 and "missing.jsonl" in lines[0], proc.stderr
