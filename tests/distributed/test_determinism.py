"""--full_determinism's switches (rlhfkit/distributed/determinism.py), their reach into Ray processes, the GPU note,
and the GPU-only kernel flags (--use_liger_kernel, --deepcompile) on a machine without a GPU. Unit tests: the
bit-identical runs are in tests/trainers/test_full_determinism.py and tests/distributed/test_ray_determinism.py."""

from __future__ import annotations

import os

import pytest
import torch

from rlhfkit.config import devices
from rlhfkit.config.base import parse_config
from rlhfkit.config.preference import DPOConfig
from rlhfkit.config.rl import PPOConfig
from rlhfkit.config.sft import SFTConfig
from rlhfkit.distributed import determinism
from rlhfkit.distributed.ray_groups import worker_env
from rlhfkit.errors import UserError
from tests.helpers import torch_determinism_restored


@pytest.fixture
def restored():
    with torch_determinism_restored():
        yield


def big_sum(x: torch.Tensor, threads: int) -> float:
    torch.set_num_threads(threads)
    return x.sum().item()


def test_the_flag_fixes_the_reduction_order_whatever_the_thread_count(restored, monkeypatch):
    """Why the flag pins one thread: a 4M-element sum (seed 0) over two threads adds its partial sums in another
    order than over one (the last bits differ); with the flag the thread count the process started with no longer
    matters."""
    monkeypatch.delenv(determinism.FLAG_ENV, raising=False)
    x = torch.randn(4_000_000, generator=torch.Generator().manual_seed(0))
    one, two = big_sum(x, 1), big_sum(x, 2)
    if torch.get_num_threads() == 2:  # torch honoured two threads here: the orders differ
        assert one != two
    determinism.enable_full_determinism()
    assert torch.are_deterministic_algorithms_enabled() and torch.get_num_threads() == 1
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8" and determinism.flag_from_env()
    assert x.sum().item() == one


def test_ray_processes_get_one_thread_and_a_fixed_hash_seed_under_the_flag(monkeypatch):
    from rlhfkit.distributed.placement import Slot

    slot = Slot("actor", 0, num_cpus=4, num_gpus=0, threads=4)
    monkeypatch.delenv(determinism.FLAG_ENV, raising=False)
    assert worker_env(slot=slot)["OMP_NUM_THREADS"] == "4" and "PYTHONHASHSEED" not in worker_env()
    monkeypatch.setenv(determinism.FLAG_ENV, "1")
    env = worker_env(slot=slot)
    assert env["OMP_NUM_THREADS"] == env["MKL_NUM_THREADS"] == "1"
    assert env["PYTHONHASHSEED"] == "0" and env[determinism.FLAG_ENV] == "1"


def test_gpu_note_lists_every_limit_and_prints_once_only_with_a_gpu(monkeypatch):
    note = determinism.gpu_limits_note()
    assert "vLLM" in note and "NCCL" in note and "flash-attention" in note and "\n" not in note
    printed: list[str] = []
    monkeypatch.setattr(determinism, "_noted", False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not determinism.note_gpu_limits(printed.append) and printed == []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert determinism.note_gpu_limits(printed.append) and not determinism.note_gpu_limits(printed.append)
    assert printed == [note]


@pytest.mark.parametrize("cls, flag", [(SFTConfig, "--full_determinism"),
                                       (DPOConfig, "--train.full_determinism_enable"),
                                       (PPOConfig, "--train.full_determinism_enable")])
def test_openrlhf_spellings_set_the_flag(cls, flag):
    assert parse_config(cls, [flag], "t").strategy.full_determinism
    assert not parse_config(cls, [], "t").strategy.full_determinism


@pytest.mark.parametrize("flags, needle", [
    (["--use_liger_kernel"], "--use_liger_kernel needs a CUDA GPU and the liger_kernel package"),
    (["--ds.use_liger_kernel"], "--use_liger_kernel needs a CUDA GPU"),
    (["--deepcompile"], "--deepcompile needs a CUDA GPU (DeepSpeed compiles for CUDA devices), missing here"),
    (["--ds.deepcompile"], "--deepcompile needs a CUDA GPU"),
])
def test_gpu_only_kernel_flags_stop_on_cpu_with_the_reason(flags, needle, monkeypatch):
    monkeypatch.setattr(devices, "cuda_available", lambda: False)
    with pytest.raises(UserError, match="missing here") as err:
        parse_config(PPOConfig, flags, "t")
    assert needle in str(err.value)


def test_liger_on_a_gpu_without_the_package_names_the_package(monkeypatch):
    monkeypatch.setattr(devices, "cuda_available", lambda: True)
    monkeypatch.setattr(devices, "auto_bf16", lambda: False)
    monkeypatch.setattr(devices, "auto_attn_implementation", lambda: "sdpa")
    monkeypatch.setattr(devices.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(UserError, match=r"^--use_liger_kernel needs the liger_kernel package \(") as err:
        devices.check_gpu_only("use_liger_kernel", "Liger's kernels are Triton GPU kernels", package="liger_kernel")
    assert "CUDA" not in str(err.value)


def test_deepcompile_goes_into_the_deepspeed_config_and_off_the_plain_engine(monkeypatch):
    from rlhfkit.distributed.strategy import DeepSpeedStrategy

    monkeypatch.setattr(devices, "cuda_available", lambda: True)
    cfg = parse_config(SFTConfig, ["--deepcompile", "--param_dtype", "fp32"], "t")
    strategy = DeepSpeedStrategy(cfg.strategy)
    assert strategy.ds_config(train=True)["compile"] == {"deepcompile": True}
    assert "compile" not in strategy.ds_config(train=False) and not strategy.uses_plain_torch_engine()


def test_train_rm_refuses_liger_on_a_gpu_with_the_package(monkeypatch):
    from rlhfkit.config.preference import RMConfig

    real = devices.importlib.util.find_spec
    monkeypatch.setattr(devices, "cuda_available", lambda: True)
    monkeypatch.setattr(devices.importlib.util, "find_spec", lambda name: object() if name == "liger_kernel"
                        else real(name))
    with pytest.raises(UserError, match="train_rm trains a value model"):
        parse_config(RMConfig, ["--use_liger_kernel", "--param_dtype", "fp32"], "t")
