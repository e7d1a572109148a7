"""Checkpoints: --use_ds_universal_ckpt resumes at another ZeRO stage and world size exactly, --max_ckpt_mem prunes
by size; rotation stays inside the current run, resume takes the newest complete checkpoint and checks what it
resumes."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from rlhfkit.config.base import parse_config
from rlhfkit.config.sft import SFTConfig

TEMPLATE = "User: {}\nAssistant: "


def sft_argv(assets, save: Path, *extra: str) -> list[str]:
    return ["--pretrain", str(assets.model_dir), "--dataset", str(assets.sft_train), "--input_key", "question",
            "--output_key", "response", "--input_template", TEMPLATE, "--max_len", "40", "--max_samples", "32",
            "--train_batch_size", "8", "--micro_train_batch_size", "4", "--learning_rate", "1e-3",
            "--lr_warmup_ratio", "0.25", "--save_path", str(save), "--metrics_path", str(save / "m.jsonl"),
            "--disable_progress_bar", "--l2", "0.01", "--max_epochs", "1", *extra]


def sft(assets, save: Path, *extra: str) -> list[dict]:
    """run_sft in this process (a world of one); returns the per-step training metrics."""
    from rlhfkit.trainers.sft import run_sft

    history = run_sft(parse_config(SFTConfig, sft_argv(assets, save, *extra), "test")).history
    return [{"loss": m["loss"], "lr": m["lr"]} for m in history]


def sft_ranks(assets, save: Path, *extra: str, ranks: int = 2) -> list[dict]:
    """train_sft under torchrun with `ranks` ranks; returns the per-step metrics from its JSONL file."""
    from rlhfkit.distributed.launch import free_port
    from tests.helpers import run_module

    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_addr",
                "127.0.0.1", "--master_port", str(free_port()), "-m"]
    proc = run_module(["rlhfkit.cli.train_sft", *sft_argv(assets, save, *extra)], launcher=launcher)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [json.loads(x) for x in (save / "m.jsonl").read_text().splitlines()]
    return [{"loss": x["train/loss"], "lr": x["train/lr"]} for x in lines if "train/loss" in x]


def assert_same_weights(one: Path, two: Path) -> None:
    from safetensors.torch import load_file

    a, b = load_file(str(one / "model.safetensors")), load_file(str(two / "model.safetensors"))
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-5, atol=1e-5, msg=name)


def test_universal_checkpoint_resumes_exactly_at_another_zero_stage_and_world_size(demo_assets, tmp_path,
                                                                                    world_of_one):
    """1 rank ZeRO-2 -> (universal) -> 2 ranks ZeRO-3 -> (universal) -> 1 rank ZeRO-0, and the 2-rank ZeRO-3
    save -> 4 ranks ZeRO-3, give the uninterrupted ZeRO-2 run's losses and learning rates step for step and its
    final weights to 1e-5 (weights, Adam moments and step, LR schedule and data position all carried over; no rank
    gathers the model: each writes and reads its own part)."""
    reference = sft(demo_assets, tmp_path / "ref", "--zero_stage", "2")
    assert len(reference) == 4
    ckpt = tmp_path / "ckpt"
    common = ("--ckpt_path", str(ckpt), "--save_steps", "1", "--use_ds_universal_ckpt")
    runs = [sft(demo_assets, tmp_path / "zero2", "--zero_stage", "2", "--max_steps", "2", *common)]
    step2 = ckpt / "global_step2" / "model"
    assert (step2 / "universal_state.pt").is_file() and not list(step2.glob("*optim_states.pt"))
    runs.append(sft_ranks(demo_assets, tmp_path / "zero3", "--zero_stage", "3", "--max_steps", "3",
                          "--load_checkpoint", *common))
    assert (ckpt / "global_step3" / "model" / "universal_shard_rank00001.pt").is_file()  # rank 1 of 2 wrote its part
    shutil.copytree(ckpt, tmp_path / "ckpt4")
    runs.append(sft(demo_assets, tmp_path / "zero0", "--zero_stage", "0", "--load_checkpoint", *common))
    four = sft_ranks(demo_assets, tmp_path / "zero3x4", "--zero_stage", "3", "--micro_train_batch_size", "2",
                     "--load_checkpoint", *common[2:], "--ckpt_path", str(tmp_path / "ckpt4"), ranks=4)
    assert [len(r) for r in runs] == [2, 1, 1] and len(four) == 1
    resumed = [m for r in runs for m in r]
    for key in ("loss", "lr"):
        assert [m[key] for m in resumed] == pytest.approx([m[key] for m in reference], rel=1e-5, abs=1e-7), key
        assert four[0][key] == pytest.approx(reference[3][key], rel=1e-5, abs=1e-7), key
    assert resumed[3]["loss"] < resumed[0]["loss"]  # it trained: the comparison is not between constants
    assert_same_weights(tmp_path / "ref", tmp_path / "zero0")
    assert_same_weights(tmp_path / "ref", tmp_path / "zero3x4")


def test_max_ckpt_mem_prunes_oldest_by_total_size(tmp_path):
    from rlhfkit.run.checkpoint import prune_checkpoints

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


# -- kill safety, rotation and resume checks of ckpt.py, on a role-like target (no model needed) ----------------
class TensorRole:
    """The engine-like checkpoint protocol the RL roles implement, holding one tensor."""

    def __init__(self, value: float = 0.0):
        self.w = torch.tensor([value])

    def save_checkpoint(self, save_dir: str, tag: str, save_latest: bool = False) -> None:
        (Path(save_dir) / tag).mkdir(parents=True, exist_ok=True)
        torch.save(self.w, Path(save_dir) / tag / "w.pt")

    def load_checkpoint(self, load_dir: str, tag: str):
        f = Path(load_dir) / tag / "w.pt"
        if not f.is_file():
            return None, None
        self.w = torch.load(f)
        return load_dir, None


def save(root: Path, step: int, run, value: float, max_keep: int = 10) -> Path:
    from rlhfkit.rl.ray_run import DriverStrategy
    from rlhfkit.run.checkpoint import save_checkpoint

    return save_checkpoint(DriverStrategy(), str(root), step, {"m": TensorRole(value)}, {"epoch": 0}, max_keep,
                           run=run)


def resumed(root: Path, run, capsys=None):
    from rlhfkit.rl.ray_run import DriverStrategy
    from rlhfkit.run.checkpoint import resume

    role = TensorRole()
    found = resume(DriverStrategy(), str(root), {"m": role}, run)
    return (None if found is None else found[0].name), float(role.w[0])


def test_each_process_saves_and_restores_its_own_rng_file(tmp_path, monkeypatch):
    """The two ranks of a tensor-parallel pair share `strategy.rank` (0 here, as the driver's); each process still
    writes and reads back the RNG file of its global rank, so neither overwrites the other's generators."""
    from rlhfkit.run import checkpoint

    monkeypatch.setattr(checkpoint, "process_rank", lambda: 1)
    torch.manual_seed(7)
    path = save(tmp_path, 1, run_info(), 1.0)
    assert sorted(p.name for p in path.glob("rng_rank*.pt")) == ["rng_rank1.pt"]
    expected = torch.rand(3)
    torch.manual_seed(8)
    assert resumed(tmp_path, run_info()) == ("global_step1", 1.0)
    torch.testing.assert_close(torch.rand(3), expected)  # rank 1's generator state, read back from rng_rank1.pt


def run_info(trainer: str = "sft", **config):
    from rlhfkit.run.runs import RunInfo

    base = {"model": {"pretrain": "/m"}, "strategy": {"train_batch_size": 8, "learning_rate": 1e-3},
            "logging": {"logging_steps": 1}}
    for key, value in config.items():
        section, field = key.split("__")
        base[section] = {**base[section], field: value}
    return RunInfo(trainer, base)


def test_rotation_prunes_only_the_current_runs_checkpoints(tmp_path):
    """The issue's silent loss: an older run's global_step1..4 sit in the shared --ckpt_path; the new run's fresh
    global_step1 was the 'oldest' by step number and was pruned as soon as it was written (exit 0, nothing kept).
    Now rotation counts and removes this run's checkpoints only and never the newest."""
    old, new = run_info(), run_info()
    for step in range(1, 5):
        save(tmp_path, step, old, float(step), max_keep=2)
    assert sorted(p.name for p in tmp_path.glob("global_step*")) == ["global_step3", "global_step4"]
    save(tmp_path, 1, new, 10.0, max_keep=1)
    assert sorted(p.name for p in tmp_path.glob("global_step*")) == ["global_step1", "global_step3", "global_step4"]
    assert json.loads((tmp_path / "global_step1" / "rlhfkit_ckpt.json").read_text())["run_id"] == new.run_id
    assert (tmp_path / "latest").read_text() == "global_step1"
    assert not (tmp_path / ".incomplete").exists()  # no empty staging directory left behind


def test_missing_latest_resumes_from_the_newest_complete_checkpoint(tmp_path, capsys):
    run = run_info()
    for step in (1, 2):
        save(tmp_path, step, run, float(step))
    (tmp_path / "latest").unlink()
    assert resumed(tmp_path, run_info()) == ("global_step2", 2.0)
    assert "latest is missing; resuming from the newest complete checkpoint, global_step2" in capsys.readouterr().out


def test_truncated_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, capsys):
    run = run_info()
    for step in (1, 2):
        save(tmp_path, step, run, float(step))
    weights = tmp_path / "global_step2" / "m" / "w.pt"
    weights.write_bytes(weights.read_bytes()[:20])  # was a raw traceback from torch.load
    resuming = run_info()
    assert resumed(tmp_path, resuming) == ("global_step1", 1.0)
    out = capsys.readouterr().out
    assert "skipping" in out and "m/w.pt is truncated" in out and "global_step1" in out
    assert resuming.run_id == run.run_id  # the resumed run continues the same run (rotation covers its steps)


def test_a_damaged_checkpoint_the_manifest_cannot_see_falls_back_when_loading_fails(tmp_path, capsys):
    run = run_info()
    for step in (1, 2):
        save(tmp_path, step, run, float(step))
    weights = tmp_path / "global_step2" / "m" / "w.pt"
    weights.write_bytes(b"\0" * weights.stat().st_size)  # same size, garbage content
    assert resumed(tmp_path, run_info()) == ("global_step1", 1.0)
    assert "could not load" in capsys.readouterr().out


def test_a_kill_mid_save_leaves_the_previous_checkpoint_the_one_resumed(tmp_path):
    run = run_info()
    save(tmp_path, 1, run, 1.0)
    partial = tmp_path / ".incomplete" / "global_step2"  # what a SIGKILL before the rename leaves
    TensorRole(2.0).save_checkpoint(str(partial), "m")
    assert resumed(tmp_path, run_info()) == ("global_step1", 1.0)
    save(tmp_path, 2, run, 2.5)  # the next save clears the leftovers
    assert not (tmp_path / ".incomplete").exists()
    assert resumed(tmp_path, run_info()) == ("global_step2", 2.5)


def test_resume_error_for_another_trainer_or_another_model_or_batch_size(tmp_path):
    from rlhfkit.errors import UserError

    save(tmp_path, 1, run_info("sft"), 1.0)
    with pytest.raises(UserError, match="written by sft, not dpo"):
        resumed(tmp_path, run_info("dpo"))
    with pytest.raises(UserError, match="--train_batch_size 8 -> 16"):
        resumed(tmp_path, run_info(strategy__train_batch_size=16))
    with pytest.raises(UserError, match="--pretrain '/m' -> '/other'"):
        resumed(tmp_path, run_info(model__pretrain="/other"))


def test_resume_continues_with_a_warning_for_harmless_changes(tmp_path, capsys):
    save(tmp_path, 1, run_info(), 1.0)
    assert resumed(tmp_path, run_info()) == ("global_step1", 1.0)
    assert "warning" not in capsys.readouterr().out
    assert resumed(tmp_path, run_info(logging__logging_steps=5)) == ("global_step1", 1.0)
    assert "warning: resuming with changed settings: --logging_steps 1 -> 5" in capsys.readouterr().out
    assert resumed(tmp_path, run_info(strategy__learning_rate=5e-4)) == ("global_step1", 1.0)
    assert "warning: resuming with changed settings: --learning_rate 0.001 -> 0.0005" in capsys.readouterr().out


def test_new_run_error_on_another_runs_ckpt_path_unless_resuming_or_overwriting(tmp_path):
    from rlhfkit.errors import UserError
    from rlhfkit.run.runs import claim_ckpt_dir

    save(tmp_path, 3, run_info("dpo"), 1.0)
    (tmp_path / ".incomplete" / "global_step4").mkdir(parents=True)
    with pytest.raises(UserError, match=r"already holds checkpoints of a dpo run \(newest: global_step3\); add "
                                        "--load_checkpoint to resume it, --overwrite_ckpt to delete them"):
        claim_ckpt_dir(str(tmp_path), resume=False, overwrite=False, rank0=True)
    assert not (tmp_path / ".incomplete").exists()
    assert claim_ckpt_dir(str(tmp_path), resume=True, overwrite=False, rank0=True) == []
    assert (tmp_path / "global_step3").is_dir()
    notes = claim_ckpt_dir(str(tmp_path), resume=False, overwrite=True, rank0=True)
    assert notes and "removed 1 checkpoint" in notes[0]
    assert list(tmp_path.iterdir()) == []
