"""SIGTERM (schedulers, spot instances) stops training at a step boundary with a checkpoint and exit code 0, and
`--load_checkpoint` then reaches the same final weights as a run that was never interrupted."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from rlhfkit.run.preemption import PreemptionWatch
from tests.helpers import run_here
from tests.run.signalled_runs import TEMPLATE, max_weight_diff, rl_args, start


class _OneRank:
    world_size = 1


def test_watch_sets_its_flag_on_sigterm_and_restores_the_previous_handler():
    previous = signal.getsignal(signal.SIGTERM)
    with PreemptionWatch(_OneRank()) as watch:
        assert not watch.requested()
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        assert watch.requested()
    assert signal.getsignal(signal.SIGTERM) is previous


def finish(proc: subprocess.Popen, timeout: float = 600) -> tuple[int, str]:
    _, err = proc.communicate(timeout=timeout)
    return proc.returncode, err


def sigterm_after_first_step(proc: subprocess.Popen, metrics: Path, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not (metrics.is_file() and metrics.read_text().count("\n") >= 1):
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "no training step logged in time"
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)


def check_preempted_then_resumed(args_for, tmp_path: Path, steps: int, capsys) -> None:
    """The uninterrupted run and the resumed one run in this process (`run_here`: the same CLI main, without a
    process's start-up); the run that gets the signal is a process of its own."""
    full = tmp_path / "full"
    done = run_here(args_for(full), capsys)
    assert done.returncode == 0, done.stderr[-3000:]
    part, ckpt = tmp_path / "part", tmp_path / "ckpt"
    proc = start(args_for(part, "--ckpt_path", str(ckpt)))
    sigterm_after_first_step(proc, part / "metrics.jsonl")
    code, err = finish(proc)
    assert code == 0, err[-3000:]
    assert "stopped by SIGTERM after step" in err and "--load_checkpoint" in err and "Traceback" not in err
    stopped_at = int(err.split("stopped by SIGTERM after step ")[1].split(";")[0])
    assert 1 <= stopped_at < steps, "the run finished before the signal landed: make it longer"
    assert (ckpt / "latest").read_text() == f"global_step{stopped_at}"
    assert not (part / "model.safetensors").exists()  # an interrupted run does not pose as a finished model
    done = run_here(args_for(part, "--ckpt_path", str(ckpt), "--load_checkpoint"), capsys)
    assert done.returncode == 0, done.stderr[-3000:]
    assert max_weight_diff(full, part) <= 1e-6


def test_sft_sigterm_saves_exits_0_and_resumes_exactly(demo_assets, tmp_path, capsys):
    def args_for(save: Path, *extra: str) -> list[str]:
        return ["rlhfkit.cli.train_sft", "--pretrain", str(demo_assets.model_dir), "--dataset",
                str(demo_assets.sft_train), "--max_samples", "480", "--max_epochs", "1", "--input_key", "question",
                "--output_key",
                "response", "--input_template", TEMPLATE, "--max_len", "48", "--train_batch_size", "8",
                "--micro_train_batch_size", "8", "--learning_rate", "1e-3", "--zero_stage", "0",
                "--save_path", str(save), "--disable_progress_bar", *extra]

    check_preempted_then_resumed(args_for, tmp_path, steps=60, capsys=capsys)


def test_rl_sigterm_saves_exits_0_and_resumes_exactly(demo_assets, tmp_path, capsys):
    def args_for(save: Path, *extra: str) -> list[str]:
        return rl_args(demo_assets, tmp_path, save, *extra, rollout_batch_size=4, train_batch_size=8,
                       micro_train_batch_size=4, max_samples=40, generate_max_len=8)

    check_preempted_then_resumed(args_for, tmp_path, steps=10, capsys=capsys)


@pytest.fixture(autouse=True)
def _no_torch_threads():
    torch.set_num_threads(1)
