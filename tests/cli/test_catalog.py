"""rlhfkit.cli.catalog: the commands of main.COMMANDS, their config classes and parsers, without running them."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rlhfkit.cli import catalog, main
from rlhfkit.config.preference import ServeRMConfig
from rlhfkit.config.rl import PPOConfig
from rlhfkit.config.sft import SFTConfig


def test_commands_follow_main_and_skip_a_command_registered_before_its_module(monkeypatch):
    assert [c.name for c in catalog.commands()] == list(main._available())  # what `rlhfkit --help` lists
    monkeypatch.setitem(main.COMMANDS, "not_yet", ("not_written_yet", "a command whose module has not landed"))
    names = [c.name for c in catalog.commands()]
    assert "not_yet" not in names and "train_sft" in names
    assert catalog.by_module("train_ppo_ray").name == "train_ppo_ray" and catalog.by_module("nope") is None


def test_config_class_comes_from_the_table_or_the_module():
    assert catalog.config_class(catalog.by_module("train_sft")) is SFTConfig  # listed in config.docs.TABLES
    assert catalog.config_class(catalog.by_module("train_ppo_ray")) is PPOConfig  # found in the module
    assert catalog.config_class(catalog.by_module("serve_rm")) is ServeRMConfig
    assert catalog.config_class(catalog.by_module("demo")) is None  # a hand-written argparse parser


def test_parser_of_a_hand_written_cli_stops_at_parsing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    parser = catalog.parser_of(catalog.by_module("demo"))
    assert {"--out", "--sft_steps", "--engine"} <= {o for a in parser._actions for o in a.option_strings}
    assert list(tmp_path.iterdir()) == [], "the demo must not have started"
    import argparse

    assert argparse.ArgumentParser.parse_args.__name__ == "parse_args", "argparse is restored"


def test_parse_flags_accepts_good_flags_and_exits_2_on_bad_ones():
    cfg = catalog.parse_flags(catalog.by_module("train_ppo_ray"), ["--pretrain", "m", "--vllm_num_engines", "2"])
    assert cfg.model.pretrain == "m" and cfg.rollout.vllm_num_engines == 2
    assert catalog.parse_flags(catalog.by_module("demo"), ["--sft_steps", "3"]).sft_steps == 3
    with pytest.raises(SystemExit) as e:
        catalog.parse_flags(catalog.by_module("train_sft"), ["--no_such_flag"])
    assert e.value.code == 2


def test_module_prints_the_command_names():
    proc = subprocess.run([sys.executable, "-m", "rlhfkit.cli.catalog"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.split() == [c.name for c in catalog.commands()]
