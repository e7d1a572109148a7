"""`python -m rlhfkit.cli.demo_assets`: prints where everything is; bad input is one line and exit code 2."""

from __future__ import annotations

import pytest

from rlhfkit.cli.demo_assets import main


def test_builds_or_reuses_and_prints_paths(demo_assets, capsys):
    assert main(["--out", str(demo_assets.root), "--seed", "0"]) == 0  # same arguments: reused, instant
    out = capsys.readouterr().out
    assert str(demo_assets.model_dir) in out and str(demo_assets.rl_train) in out
    assert "--pretrain" in out and "User: {}" in out


@pytest.mark.parametrize("argv, message", [
    (["--seed", "1"], "--out"),
    (["--out", "x", "--seed", "minus"], "whole number"),
    (["--out", "x", "--seed", "-3"], ">= 0"),
    (["--out", "x", "--colour", "red"], "unrecognized"),
])
def test_bad_flags_are_one_line_and_exit_2(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and "Traceback" not in err


def test_out_pointing_at_a_file_is_a_user_error(tmp_path, capsys):
    (tmp_path / "f").write_text("x")
    assert main(["--out", str(tmp_path / "f")]) == 2
    assert "is a file" in capsys.readouterr().err


def test_help_exits_0(capsys):
    assert main(["--help"]) == 0
    assert "--out" in capsys.readouterr().out
