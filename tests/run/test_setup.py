"""Fail before the work (rlhfkit.run.setup.prepare_run): unwritable outputs, runs that would train nothing,
another run's checkpoints and plain models given as reward models are one-line errors (exit code 2, no traceback)
raised before any model loads. Each CLI runs in this process: these errors come before any process group starts.

Every case passes `--pretrain` a directory that is not a model, so an error about anything else proves the check
ran before the model (or its tokenizer) was read."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

from rlhfkit.cli.common import run_cli
from tests.helpers import REPO, error_lines

TEMPLATE = "User: {}\nAssistant: "


def error_line(capsys, module: str, *argv: str) -> str:
    main = importlib.import_module(f"rlhfkit.cli.{module}").main
    capsys.readouterr()
    try:
        code = run_cli(main, list(argv), prog=module)
    except SystemExit as e:
        code = e.code
    err = error_lines(capsys.readouterr().err)
    assert code == 2 and len(err) == 1 and "Traceback" not in err[0], err
    return err[0]


@pytest.fixture()
def not_a_model(tmp_path) -> Path:
    d = tmp_path / "not_a_model"
    d.mkdir()
    return d


def sft(assets, model: Path, save: Path, *extra: str) -> list[str]:
    return ["--pretrain", str(model), "--dataset", str(assets.sft_train), "--input_key", "question", "--output_key",
            "response", "--input_template", TEMPLATE, "--train_batch_size", "8", "--micro_train_batch_size", "4",
            "--save_path", str(save), "--disable_progress_bar", *extra]


def ppo(assets, model: Path, save: Path, *extra: str) -> list[str]:
    return ["--pretrain", str(model), "--prompt_data", str(assets.rl_train), "--input_key", "prompt",
            "--rollout_batch_size", "2", "--n_samples_per_prompt", "2", "--train_batch_size", "4",
            "--micro_train_batch_size", "2", "--micro_rollout_batch_size", "4", "--save_path", str(save),
            "--disable_progress_bar", *extra]


@pytest.mark.parametrize("flag, fragment", [
    ("--save_path", "--save_path {bad} is under {file}, which is a file, not a directory"),
    ("--ckpt_path", "--ckpt_path {bad} is under {file}, which is a file, not a directory"),
    ("--use_tensorboard", "--use_tensorboard {bad} is under {file}, which is a file"),
])
def test_output_path_under_a_file_is_an_error_before_any_model_loads(demo_assets, not_a_model, tmp_path, capsys,
                                                                      flag, fragment):
    file = tmp_path / "a_file"
    file.write_text("x")
    bad = file / "out"
    save = tmp_path / "save" if flag != "--save_path" else bad
    extra = [] if flag == "--save_path" else [flag, str(bad)]
    line = error_line(capsys, "train_sft", *sft(demo_assets, not_a_model, save, *extra))
    assert fragment.format(bad=bad, file=file) in line
    assert not (tmp_path / "save").exists()  # nothing was written before the check


def test_metrics_path_under_a_file_is_an_error(demo_assets, not_a_model, tmp_path, capsys):
    file = tmp_path / "a_file"
    file.write_text("x")
    line = error_line(capsys, "train_dpo", "--pretrain", str(not_a_model), "--dataset", str(demo_assets.pref_train),
                      "--save_path", str(tmp_path / "save"), "--metrics_path", str(file / "m.jsonl"))
    assert f"--metrics_path {file} is a file, not a directory" in line


def test_invalid_max_epochs_0_is_an_error_not_an_untrained_model(demo_assets, not_a_model, tmp_path, capsys):
    line = error_line(capsys, "train_sft", *sft(demo_assets, not_a_model, tmp_path / "s", "--max_epochs", "0"))
    assert "--max_epochs 0: a run needs at least one epoch" in line
    line = error_line(capsys, "train_dpo", "--pretrain", str(not_a_model), "--dataset", str(demo_assets.pref_train),
                      "--save_path", str(tmp_path / "d"), "--max_steps", "0")
    assert "--max_steps 0 trains nothing" in line
    assert not (tmp_path / "s").exists() and not (tmp_path / "d").exists()


def test_ckpt_path_of_another_run_is_an_error_unless_resuming_or_overwriting(demo_assets, not_a_model, tmp_path,
                                                                               capsys):
    ckpt = tmp_path / "ckpt" / "global_step4"
    ckpt.mkdir(parents=True)
    (ckpt / "rlhfkit_ckpt.json").write_text(json.dumps({"run_id": "x", "trainer": "sft", "files": {}}))
    line = error_line(capsys, "train_sft", *sft(demo_assets, not_a_model, tmp_path / "s", "--ckpt_path",
                                                  str(tmp_path / "ckpt")))
    assert f"--ckpt_path {tmp_path / 'ckpt'} already holds checkpoints of a sft run (newest: global_step4)" in line
    assert "--load_checkpoint" in line and "--overwrite_ckpt" in line
    # with --overwrite_ckpt they go, and the run gets as far as the (bad) model
    line = error_line(capsys, "train_sft", *sft(demo_assets, not_a_model, tmp_path / "s", "--ckpt_path",
                                                  str(tmp_path / "ckpt"), "--overwrite_ckpt"))
    assert "--pretrain" in line and not ckpt.exists()


def test_the_critics_save_path_twin_must_be_writable_too(demo_assets, not_a_model, tmp_path, capsys):
    """--save_value_network writes the critic to <save_path>_critic: an RL run checks that path with the others."""
    twin = tmp_path / "p_critic"
    twin.write_text("x")
    reward = str(REPO / "tests/distributed/reward_exact_match.py")
    line = error_line(capsys, "train_ppo", *ppo(demo_assets, not_a_model, tmp_path / "p", "--remote_rm_url", reward,
                                                  "--advantage_estimator", "gae", "--save_value_network"))
    assert f"--save_path (its _critic twin) {twin} is a file, not a directory" in line


def test_plain_model_as_reward_pretrain_is_an_error_naming_the_missing_head(demo_assets, not_a_model, tmp_path,
                                                                             capsys):
    """The issue's random-reward PPO: a language model without a value head given as --reward_pretrain."""
    line = error_line(capsys, "train_ppo", *ppo(demo_assets, not_a_model, tmp_path / "p", "--reward_pretrain",
                                                  str(demo_assets.model_dir), "--advantage_estimator", "group_norm"))
    assert f"--reward_pretrain {demo_assets.model_dir} is not a reward model: score.weight is not in the " \
           "checkpoint" in line


def test_plain_model_as_critic_pretrain_is_an_error_unless_asked_for(demo_assets, not_a_model, tmp_path, capsys):
    reward = str(REPO / "tests/distributed/reward_exact_match.py")
    args = ppo(demo_assets, not_a_model, tmp_path / "p", "--remote_rm_url", reward, "--critic_pretrain",
               str(demo_assets.model_dir), "--advantage_estimator", "gae")
    line = error_line(capsys, "train_ppo", *args)
    assert "--critic_pretrain" in line and "score.weight is not in the checkpoint" in line
    assert "--critic_init_head" in line
    line = error_line(capsys, "train_ppo", *args, "--critic_init_head")  # allowed: on to the (bad) --pretrain
    assert f"--pretrain {not_a_model}: not a model directory" in line
    line = error_line(capsys, "train_ppo", *ppo(demo_assets, not_a_model, tmp_path / "p", "--remote_rm_url", reward,
                                                  "--critic_init_head"))
    assert "--critic_init_head applies to the model given as --critic_pretrain" in line


def test_default_critic_from_pretrain_needs_no_head():
    """OpenRLHF's default: no critic or reward model given, the critic starts from --pretrain with a new head."""
    from rlhfkit.config.base import parse_config
    from rlhfkit.config.rl import PPOConfig, critic_needs_head

    assert not critic_needs_head(parse_config(PPOConfig, ["--pretrain", "m"], "t"))
    assert critic_needs_head(parse_config(PPOConfig, ["--pretrain", "m", "--critic_pretrain", "c"], "t"))
    assert not critic_needs_head(parse_config(PPOConfig, ["--pretrain", "m", "--critic_pretrain", "c",
                                                          "--critic_init_head"], "t"))


def test_serve_rm_plain_model_is_an_error_naming_the_missing_head(demo_assets, capsys):
    line = error_line(capsys, "serve_rm", "--reward_pretrain", str(demo_assets.model_dir), "--port", "0",
                      "--no_auth")
    assert f"--reward_pretrain {demo_assets.model_dir} is not a reward model: score.weight is not in the " \
           "checkpoint" in line
