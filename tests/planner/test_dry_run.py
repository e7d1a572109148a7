"""`rlhfkit.planner.dry_run`: which devices a dry run plans against, and that it prints a plan only when asked."""

from __future__ import annotations

import pytest
import torch

from rlhfkit.config.common import DryRunArgs
from rlhfkit.config.sft import SFTConfig
from rlhfkit.planner.dry_run import _devices, dry_run
from rlhfkit.planner.memory import GIB


def test_gpu_memory_flag_plans_for_that_many_gpus_of_that_size(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    devices, world = _devices(DryRunArgs(dry_run=True, dry_run_gpu_memory_gb=80.0, dry_run_num_gpus=8))
    assert (devices.kind, devices.memory, devices.count, world) == ("gpu", 80.0 * GIB, 8, 8)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU machine plans against its GPUs")
def test_without_a_gpu_the_host_memory_is_the_device(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    devices, world = _devices(DryRunArgs(dry_run=True))
    with open("/proc/meminfo", encoding="ascii") as f:
        total = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))
    assert devices.kind == "cpu" and 0 < devices.memory <= total and world == 2


def test_no_plan_without_the_flag(capsys):
    assert dry_run(SFTConfig(), "sft", "rlhfkit.cli.train_sft") is False
    assert capsys.readouterr().out == ""
