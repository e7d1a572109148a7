"""Flags generated from dataclass configs, config files and one-line errors."""

from __future__ import annotations

import json

import pytest

from rlhfkit.config.base import flag_table, parse_config
from rlhfkit.config.sft import SFTConfig
from rlhfkit.errors import UserError
from tests.helpers import error_lines


def test_flags_fill_nested_sections():
    cfg = parse_config(SFTConfig, ["--pretrain", "m", "--zero_stage", "3", "--packing_samples",
                                   "--adam_betas", "0.9", "0.99", "--input_template", "User: {}\nAssistant: ",
                                   "--local_rank=0"], "t")
    assert cfg.model.pretrain == "m"
    assert cfg.strategy.zero_stage == 3
    assert cfg.data.packing_samples is True
    assert cfg.strategy.adam_betas == [0.9, 0.99]
    assert cfg.data.input_template == "User: {}\nAssistant: "
    assert cfg.strategy.local_rank == 0
    assert cfg.data.apply_chat_template is False  # default kept


def test_config_file_then_flags_override(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"model": {"pretrain": "a"}, "learning_rate": 0.5, "zero_stage": 1}))
    cfg = parse_config(SFTConfig, ["--config", str(path), "--zero_stage", "0"], "t")
    assert (cfg.model.pretrain, cfg.strategy.learning_rate, cfg.strategy.zero_stage) == ("a", 0.5, 0)


def test_yaml_config_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("pretrain: b\nmax_len: 64\n")
    cfg = parse_config(SFTConfig, ["--config", str(path)], "t")
    assert (cfg.model.pretrain, cfg.data.max_len) == ("b", 64)


def test_config_file_unknown_key(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"not_a_flag": 1}))
    with pytest.raises(UserError, match="unknown option.*not_a_flag"):
        parse_config(SFTConfig, ["--config", str(path)], "t")


def test_unknown_flag_is_one_line_exit_2(capsys):
    with pytest.raises(SystemExit) as exc:
        parse_config(SFTConfig, ["--no_such_flag", "1"], "prog")
    assert exc.value.code == 2
    err = error_lines(capsys.readouterr().err)
    assert len(err) == 1 and "unrecognized arguments: --no_such_flag" in err[0]


def test_bad_choice_is_exit_2(capsys):
    with pytest.raises(SystemExit) as exc:
        parse_config(SFTConfig, ["--zero_stage", "7"], "prog")
    assert exc.value.code == 2


def test_flag_table_lists_every_flag():
    table = flag_table(SFTConfig)
    for flag in ("--pretrain", "--zero_stage", "--packing_samples", "--flash_attn", "--load_checkpoint"):
        assert f"`{flag}`" in table
