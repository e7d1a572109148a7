"""OpenRLHF's train_rm / train_dpo commands run as typed (paths and sizes aside), KTO runs from its CLI, every
OpenRLHF flag exists, and bad input is one line with exit code 2."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.helpers import error_lines, launcher_env_of_one, run_here


def cli(capsys, module: str, *args: str) -> subprocess.CompletedProcess:
    """`python -m rlhfkit.cli.<module> ...`'s main in this process (`tests.helpers.run_here`: a world of one, the
    environment restored afterwards), wandb offline and silent."""
    with launcher_env_of_one():
        os.environ.update(WANDB_MODE="offline", WANDB_SILENT="true")
        return run_here([f"rlhfkit.cli.{module}", *args], capsys)


def ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def one_line_error(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = error_lines(proc.stderr)
    assert len(lines) == 1, proc.stderr
    return lines[0]


@pytest.fixture(scope="module")
def chat_pairs(demo_assets, tmp_path_factory) -> Path:
    """The demo pairs in OpenRLHF's dataset shape: `chosen` / `rejected` are whole conversations."""
    out = tmp_path_factory.mktemp("chat") / "pairs.jsonl"
    rows = [json.loads(line) for line in open(demo_assets.pref_train)][:16]
    out.write_text("".join(json.dumps({"chosen": r["chosen_messages"], "rejected": r["rejected_messages"]}) + "\n"
                           for r in rows))
    return out


def metrics(save: Path) -> list[dict]:
    return [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]


def test_seed_reward_model_command(demo_assets, chat_pairs, tmp_path, capsys):
    """Seed: deepspeed --module openrlhf.cli.train_rm ... --zero_stage 3 --bf16 --packing_samples ... (--flash_attn
    is GPU-only and covered below)."""
    save = tmp_path / "rm"
    ok(cli(capsys, "train_rm", "--save_path", str(save), "--save_steps", "-1", "--logging_steps", "1",
           "--eval_steps", "-1", "--train_batch_size", "8", "--micro_train_batch_size", "1", "--pretrain",
           str(demo_assets.model_dir),
           "--bf16", "--max_epochs", "1", "--max_len", "64", "--zero_stage", "3", "--learning_rate", "9e-6",
           "--dataset", str(chat_pairs), "--apply_chat_template", "--chosen_key", "chosen", "--rejected_key",
           "rejected", "--packing_samples", "--gradient_checkpointing", "--use_wandb", "dummy-token"))
    steps = [m for m in metrics(save) if "train/loss" in m]
    assert len(steps) == 2 and all(0 < m["train/loss"] < 5 for m in steps)
    config = json.loads((save / "config.json").read_text())
    assert config["architectures"] == ["LlamaForSequenceClassification"]
    assert config["reward_std"] > 0 and "reward_mean" in config and config["normalize_reward"] is False
    from rlhfkit.models.value_model import load_value_model

    assert load_value_model(str(save)).config.value_head_prefix == "score"


def test_seed_dpo_command(demo_assets, chat_pairs, tmp_path, capsys):
    """Seed: deepspeed --module openrlhf.cli.train_dpo ... --zero_stage 3 --beta 0.1 --bf16 ..."""
    save = tmp_path / "dpo"
    ok(cli(capsys, "train_dpo", "--save_path", str(save), "--save_steps", "-1", "--logging_steps", "1",
           "--eval_steps", "-1", "--train_batch_size", "8", "--micro_train_batch_size", "2", "--pretrain",
           str(demo_assets.model_dir),
           "--bf16", "--max_epochs", "1", "--max_len", "64", "--zero_stage", "3", "--learning_rate", "5e-7",
           "--beta", "0.1", "--dataset", str(chat_pairs), "--apply_chat_template", "--chosen_key", "chosen",
           "--rejected_key", "rejected", "--gradient_checkpointing"))
    steps = [m for m in metrics(save) if "train/loss" in m]
    assert len(steps) == 2 and steps[0]["train/loss"] == pytest.approx(0.6931, abs=2e-2)  # bf16 policy == ref
    assert (save / "model.safetensors").is_file() and (save / "tokenizer.json").is_file()


def test_kto_command(demo_assets, tmp_path, capsys):
    save = tmp_path / "kto"
    ok(cli(capsys, "train_kto", "--pretrain", str(demo_assets.model_dir), "--dataset", str(demo_assets.kto_train),
           "--input_key", "prompt", "--output_key", "completion", "--label_key", "label", "--input_template",
           "User: {}\nAssistant: ", "--max_samples", "32", "--train_batch_size", "16", "--micro_train_batch_size",
           "8", "--max_len", "64", "--zero_stage", "2", "--beta", "0.1", "--desirable_loss_weight", "1.0",
           "--undesirable_loss_weight", "1.0", "--save_path", str(save), "--learning_rate", "1e-4"))
    assert [m["train/kto_loss"] for m in metrics(save) if "train/kto_loss" in m][0] == pytest.approx(0.5, abs=1e-5)


def in_process_error(capsys, module: str, *argv: str) -> str:
    """A CLI's main in this process (these errors are raised before any process group or model load): exit code 2
    and one line of error."""
    done = run_here([f"rlhfkit.cli.{module}", *argv], capsys)
    err = error_lines(done.stderr)
    assert done.returncode == 2 and len(err) == 1, err
    return err[0]


def test_flash_attn_on_cpu_is_a_clear_one_line_error(demo_assets, chat_pairs, tmp_path, capsys):
    line = in_process_error(capsys, "train_dpo", "--pretrain", str(demo_assets.model_dir), "--dataset",
                            str(chat_pairs), "--apply_chat_template", "--flash_attn", "--save_path", str(tmp_path))
    assert "flash-attn" in line and "sdpa" in line


def test_missing_chosen_key_names_file_and_record(demo_assets, tmp_path, capsys):
    bad = tmp_path / "pairs.jsonl"
    bad.write_text('{"prompt": "a", "answer": "b", "rejected": "c"}\n')
    line = one_line_error(cli(capsys, "train_rm", "--pretrain", str(demo_assets.model_dir), "--dataset", str(bad),
                              "--prompt_key", "prompt", "--train_batch_size", "1", "--micro_train_batch_size", "1",
                              "--save_path", str(tmp_path / "out")))
    assert f"{bad}: record 1 has no key 'chosen'" in line and "--chosen_key" in line


@pytest.mark.parametrize("module, argv, needle", [
    ("train_dpo", ["--beta", "0"], "--beta must be > 0"),
    ("train_dpo", ["--ipo", "--label_smoothing", "0.1"], "--label_smoothing"),
    ("train_kto", ["--micro_train_batch_size", "1", "--train_batch_size", "1"], "--micro_train_batch_size >= 2"),
    ("train_rm", ["--loss", "hinge"], "invalid choice"),
])
def test_bad_flags_are_one_line_errors(demo_assets, tmp_path, capsys, module, argv, needle):
    line = in_process_error(capsys, module, "--pretrain", str(demo_assets.model_dir), "--dataset",
                            str(demo_assets.pref_train), "--save_path", str(tmp_path), *argv)
    assert needle in line


def test_every_openrlhf_flag_is_accepted():
    from rlhfkit.config.base import iter_fields
    from rlhfkit.config.preference import DPOConfig, KTOConfig, RMConfig, ServeRMConfig

    def flags(cls) -> set[str]:
        return {name for _, name, _, _ in iter_fields(cls)}

    shared = {"pretrain", "dataset", "eval_dataset", "save_path", "max_epochs", "max_len", "zero_stage", "bf16",
              "flash_attn", "gradient_checkpointing", "packing_samples", "apply_chat_template", "learning_rate",
              "train_batch_size", "micro_train_batch_size", "aux_loss_coef", "compute_fp32_loss", "use_wandb"}
    assert shared | {"prompt_key", "chosen_key", "rejected_key", "margin_key", "loss", "value_head_prefix",
                     "normalize_reward"} <= flags(RMConfig)
    assert shared | {"prompt_key", "chosen_key", "rejected_key", "beta", "ipo", "label_smoothing", "nll_loss_coef",
                     "ref_offload", "ref_pretrain"} <= flags(DPOConfig)
    assert shared | {"input_key", "output_key", "label_key", "beta", "desirable_loss_weight",
                     "undesirable_loss_weight", "ref_offload", "ref_pretrain"} <= flags(KTOConfig)
    assert {"reward_pretrain", "port", "host", "api_key", "normalize_reward", "max_len", "batch_size",
            "max_body_bytes", "value_head_prefix", "bf16"} <= flags(ServeRMConfig)
