"""--backend fsdp2 at world 2 (torchrun) against the plain-torch engine at world 1 (DeepSpeed ZeRO-0's arithmetic),
fp32, 5 optimizer steps of the tiny demo model: the same losses and final weights to 1e-5 (issue 20, acceptance 1).

Both runs see the same global batches in the same order: the loop draws each step's sample indices from the seed
alone (`LoopState.next_batch`) and the ranks split that batch (`micro_batches_for_rank`), and the trainers weight
each micro-batch by the whole step's totals, so world 2 x 2 micro-batches of 2 is world 1 x 4 of 2. The SFT run
also saves a DCP checkpoint at step 3 that a world-1 and a world-4 FSDP2 run resume (resharded 2 -> 1 and 2 -> 4)
to the same losses and weights (issue 20, acceptance 2);
the DPO run adds --adam_offload (FSDP2's CPU offload of shards and AdamW state).

Also --ds_tensor_parallel_size 2 --backend fsdp2 on 2 ranks against the same world-1 runs: the same losses and final
weights to 1e-5 (issue 20, acceptance 4); the TP pair is one data-parallel rank, both see the 1-rank run's
micro-batches. The world-1 runs are module fixtures, trained once for both comparisons."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import run_module

TEMPLATE = "User: {}\nAssistant: "
STEPS = ("--max_steps", "5")


def sft_flags(assets, save: Path, *extra: str) -> list[str]:
    return ["--pretrain", str(assets.model_dir), "--dataset", str(assets.sft_train), "--input_key", "question",
            "--output_key", "response", "--input_template", TEMPLATE, "--max_len", "48", "--max_samples", "64",
            "--max_epochs", "1", "--train_batch_size", "8", "--micro_train_batch_size", "2", "--learning_rate",
            "1e-3", "--lr_warmup_ratio", "0.1", "--save_path", str(save), "--metrics_path",
            str(save / "metrics.jsonl"), "--disable_progress_bar", "--param_dtype", "fp32", *extra]


def dpo_flags(assets, save: Path, *extra: str) -> list[str]:
    return ["--pretrain", str(assets.model_dir), "--dataset", str(assets.pref_train), "--prompt_key", "prompt",
            "--input_template", TEMPLATE, "--max_len", "64", "--max_samples", "64", "--train_batch_size", "8",
            "--micro_train_batch_size", "2", "--learning_rate", "1e-3", "--save_path", str(save), "--metrics_path",
            str(save / "metrics.jsonl"), "--disable_progress_bar", "--param_dtype", "fp32", *extra]


def torchrun(module: str, flags: list[str], ranks: int = 2) -> None:
    from rlhfkit.distributed.launch import free_port

    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_addr",
                "127.0.0.1", "--master_port", str(free_port()), "-m"]
    proc = run_module([module, *flags], launcher=launcher, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def losses(save: Path) -> list[float]:
    rows = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    return [r["train/loss"] for r in rows if "train/loss" in r]


def assert_same_weights(one: Path, two: Path) -> None:
    from safetensors.torch import load_file

    a, b = load_file(str(one / "model.safetensors")), load_file(str(two / "model.safetensors"))
    assert a.keys() == b.keys()
    for name in a:
        assert b[name].dtype == a[name].dtype == torch.float32, name
        torch.testing.assert_close(b[name], a[name], rtol=1e-5, atol=1e-5, msg=name)


# DPO's gradients are differences of the chosen and rejected terms, so a few entries are ~1e-9; AdamW's
# g / (sqrt(v) + eps) turns the last bits of another summation order into up to 3e-5 of weight at eps 1e-8 (the
# one-rank run shares each pair's prompt forward, FSDP2 across ranks does not: models/shared_prefix.py; TP adds the
# row-wise layers' partial products in another order). An eps of 1e-6 in every DPO run damps those entries; a real
# error (a gradient reduced twice or not at all) would stay far above 1e-5.
DPO_EPS = ("--adam_eps", "1e-6")


@pytest.fixture(scope="module")
def sft_one_rank(demo_assets, tmp_path_factory) -> Path:
    """5 SFT steps at world 1 on the plain-torch engine (ZeRO-0's arithmetic): the reference of the SFT tests."""
    from rlhfkit.config.base import parse_config
    from rlhfkit.config.sft import SFTConfig
    from rlhfkit.trainers.sft import run_sft
    from tests.helpers import launcher_env_of_one

    one = tmp_path_factory.mktemp("sft_one_rank")
    with launcher_env_of_one():
        run_sft(parse_config(SFTConfig, sft_flags(demo_assets, one, *STEPS, "--zero_stage", "0"), "test"))
    assert len(losses(one)) == 5
    return one


@pytest.fixture(scope="module")
def dpo_one_rank(demo_assets, tmp_path_factory) -> Path:
    """5 DPO steps at world 1 (plain-torch engine, `DPO_EPS`): the reference of the DPO tests."""
    from rlhfkit.config.base import parse_config
    from rlhfkit.config.preference import DPOConfig
    from rlhfkit.trainers.dpo import run_dpo
    from tests.helpers import launcher_env_of_one

    one = tmp_path_factory.mktemp("dpo_one_rank")
    with launcher_env_of_one():
        run_dpo(parse_config(DPOConfig, dpo_flags(demo_assets, one, *STEPS, *DPO_EPS, "--zero_stage", "0"), "test"))
    assert len(losses(one)) == 5
    return one


def test_sft_matches_one_rank_and_its_checkpoint_resumes_at_world_one_and_four(demo_assets, sft_one_rank, tmp_path,
                                                                              world_of_one):
    from rlhfkit.config.base import parse_config
    from rlhfkit.config.sft import SFTConfig
    from rlhfkit.trainers.sft import run_sft

    one = sft_one_rank
    two, resumed, ckpt = (tmp_path / n for n in ("two", "resumed", "ckpt"))
    saving = ("--backend", "fsdp2", "--ckpt_path", str(ckpt), "--save_steps", "3")
    torchrun("rlhfkit.cli.train_sft", sft_flags(demo_assets, two, *STEPS, *saving))
    reference = losses(one)
    assert losses(two) == pytest.approx(reference, rel=1e-5, abs=1e-6)
    assert_same_weights(one, two)
    assert (ckpt / "global_step3" / "model" / "__1_0.distcp").is_file()  # written by rank 1 of 2

    shutil.copytree(ckpt, tmp_path / "ckpt4")  # the world-1 resume may add newer checkpoints to `ckpt`
    run_sft(parse_config(SFTConfig, sft_flags(demo_assets, resumed, *STEPS, *saving, "--load_checkpoint"), "test"))
    assert losses(resumed) == pytest.approx(reference[3:], rel=1e-5, abs=1e-6)
    assert_same_weights(one, resumed)

    four = tmp_path / "four"
    torchrun("rlhfkit.cli.train_sft", sft_flags(demo_assets, four, *STEPS, *saving, "--load_checkpoint", "--ckpt_path",
                                                str(tmp_path / "ckpt4")), ranks=4)
    assert losses(four) == pytest.approx(reference[3:], rel=1e-5, abs=1e-6)
    assert_same_weights(one, four)


def test_dpo_with_cpu_offload_matches_one_rank(dpo_one_rank, demo_assets, tmp_path):
    two = tmp_path / "two"
    torchrun("rlhfkit.cli.train_dpo", dpo_flags(demo_assets, two, *STEPS, *DPO_EPS, "--backend", "fsdp2",
                                                 "--adam_offload"))
    assert losses(two) == pytest.approx(losses(dpo_one_rank), rel=1e-5, abs=1e-6)
    assert_same_weights(dpo_one_rank, two)


def test_sft_at_tensor_parallel_two_matches_one_rank(sft_one_rank, demo_assets, tmp_path):
    two = tmp_path / "two"
    torchrun("rlhfkit.cli.train_sft", sft_flags(demo_assets, two, *STEPS, "--backend", "fsdp2",
                                                "--ds_tensor_parallel_size", "2"))
    assert losses(two) == pytest.approx(losses(sft_one_rank), rel=1e-5, abs=1e-6)
    assert_same_weights(sft_one_rank, two)


def test_dpo_at_tensor_parallel_two_matches_one_rank(dpo_one_rank, demo_assets, tmp_path):
    two = tmp_path / "two"
    torchrun("rlhfkit.cli.train_dpo", dpo_flags(demo_assets, two, *STEPS, *DPO_EPS, "--backend", "fsdp2",
                                                "--ds_tensor_parallel_size", "2"))
    assert losses(two) == pytest.approx(losses(dpo_one_rank), rel=1e-5, abs=1e-6)
    assert_same_weights(dpo_one_rank, two)
