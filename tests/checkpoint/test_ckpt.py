"""Checkpoints: --use_ds_universal_ckpt resumes at another ZeRO stage exactly, --max_ckpt_mem prunes by size."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from rlhfkit.config.base import parse_config
from rlhfkit.config.sft import SFTConfig

TEMPLATE = "User: {}\nAssistant: "


@pytest.fixture()
def world_of_one():
    from rlhfkit.distributed.launch import free_port

    saved = dict(os.environ)
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    yield
    os.environ.clear()
    os.environ.update(saved)


def sft_argv(assets, save: Path, *extra: str) -> list[str]:
    return ["--pretrain", str(assets.model_dir), "--dataset", str(assets.sft_train), "--input_key", "question",
            "--output_key", "response", "--input_template", TEMPLATE, "--max_len", "40", "--max_samples", "32",
            "--train_batch_size", "8", "--micro_train_batch_size", "4", "--learning_rate", "1e-3",
            "--lr_warmup_ratio", "0.25", "--save_path", str(save), "--metrics_path", str(save / "m.jsonl"),
            "--disable_progress_bar", "--l2", "0.01", *extra]


def sft(assets, save: Path, *extra: str) -> list[dict]:
    """run_sft in this process (a world of one); returns the per-step training metrics."""
    from rlhfkit.trainers.sft import run_sft

    history = run_sft(parse_config(SFTConfig, sft_argv(assets, save, *extra), "test")).history
    return [{"loss": m["loss"], "lr": m["lr"]} for m in history]


def sft_two_ranks(assets, save: Path, *extra: str) -> list[dict]:
    """train_sft under torchrun with 2 ranks; returns the per-step metrics from its JSONL file."""
    from rlhfkit.distributed.launch import free_port
    from tests.helpers import run_module

    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
                "127.0.0.1", "--master_port", str(free_port()), "-m"]
    proc = run_module(["rlhfkit.cli.train_sft", *sft_argv(assets, save, *extra)], launcher=launcher)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [json.loads(x) for x in (save / "m.jsonl").read_text().splitlines()]
    return [{"loss": x["train/loss"], "lr": x["train/lr"]} for x in lines if "train/loss" in x]


def test_universal_checkpoint_resumes_exactly_at_another_zero_stage_and_world_size(demo_assets, tmp_path,
                                                                                    world_of_one):
    """1 rank ZeRO-2 -> (universal) -> 2 ranks ZeRO-3 -> (universal) -> 1 rank ZeRO-0 gives the uninterrupted
    ZeRO-2 run's losses and learning rates step for step (weights, Adam moments and step, LR schedule and data
    position all carried over)."""
    reference = sft(demo_assets, tmp_path / "ref", "--zero_stage", "2")
    assert len(reference) == 4
    ckpt = tmp_path / "ckpt"
    common = ("--ckpt_path", str(ckpt), "--save_steps", "1", "--use_ds_universal_ckpt")
    runs = [sft(demo_assets, tmp_path / "zero2", "--zero_stage", "2", "--max_steps", "2", *common)]
    step2 = ckpt / "global_step2" / "model"
    assert (step2 / "universal_state.pt").is_file() and not list(step2.glob("*optim_states.pt"))
    runs.append(sft_two_ranks(demo_assets, tmp_path / "zero3", "--zero_stage", "3", "--max_steps", "3",
                              "--load_checkpoint", *common))
    runs.append(sft(demo_assets, tmp_path / "zero0", "--zero_stage", "0", "--load_checkpoint", *common))
    assert [len(r) for r in runs] == [2, 1, 1]
    resumed = [m for r in runs for m in r]
    for key in ("loss", "lr"):
        assert [m[key] for m in resumed] == pytest.approx([m[key] for m in reference], rel=1e-5, abs=1e-7), key
    assert resumed[3]["loss"] < resumed[0]["loss"]  # it trained: the comparison is not between constants


def test_max_ckpt_mem_prunes_oldest_by_total_size(tmp_path):
    from rlhfkit.checkpoint.ckpt import prune_checkpoints

    sizes_kb = {1: 300, 2: 300, 3: 500, 4: 200}
    for step, kb in sizes_kb.items():
        d = tmp_path / f"global_step{step}"
        d.mkdir()
        (d / "weights.bin").write_bytes(b"\0" * kb * 1024)
        (d / "state.json").write_text(json.dumps({"global_step": step}))
    overhead = sum(len(json.dumps({"global_step": s})) for s in sizes_kb)
    cap_gb = (700 * 1024 + overhead) / 1024**3  # steps 3 + 4 fit (700 KB); adding step 2 would not
    removed = prune_checkpoints(tmp_path, max_keep=10, max_gb=cap_gb)
    assert [p.name for p in removed] == ["global_step1", "global_step2"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step3", "global_step4"]
    # the count limit still applies, and the newest survives even alone over the cap
    assert [p.name for p in prune_checkpoints(tmp_path, max_keep=1, max_gb=1.0)] == ["global_step3"]
    assert prune_checkpoints(tmp_path, max_keep=10, max_gb=1e-9) == []
    assert [p.name for p in tmp_path.iterdir()] == ["global_step4"]
