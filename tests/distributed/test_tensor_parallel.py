"""--ds_tensor_parallel_size 2 --backend fsdp2 on 2 ranks (torchrun, gloo, fp32) against the plain-torch engine at
world 1: 5 SFT steps of the tiny demo model give the same losses and final weights to 1e-5 (issue 20, acceptance 4).
The TP pair is one data-parallel rank: both see the 1-rank run's micro-batches."""

from __future__ import annotations

import pytest

from tests.distributed.test_fsdp2_parity import STEPS, assert_same_weights, losses, sft_flags, torchrun


def test_sft_at_tensor_parallel_two_matches_one_rank(demo_assets, tmp_path, world_of_one):
    from rlhfkit.config.base import parse_config
    from rlhfkit.config.sft import SFTConfig
    from rlhfkit.trainers.sft import run_sft

    one, two = tmp_path / "one", tmp_path / "two"
    run_sft(parse_config(SFTConfig, sft_flags(demo_assets, one, *STEPS, "--zero_stage", "0"), "test"))
    torchrun("rlhfkit.cli.train_sft", sft_flags(demo_assets, two, *STEPS, "--backend", "fsdp2",
                                                "--ds_tensor_parallel_size", "2"))
    reference = losses(one)
    assert len(reference) == 5
    assert losses(two) == pytest.approx(reference, rel=1e-5, abs=1e-6)
    assert_same_weights(one, two)
