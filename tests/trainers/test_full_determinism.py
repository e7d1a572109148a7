"""--full_determinism end to end (issue 23, acceptance 5): two SFT runs and two DPO runs with the flag, 2 steps on
the tiny demo model, give bit-identical final weights, the first run started with two intra-op threads and the
second with one (the flag pins one: rlhfkit/distributed/determinism.py). In process, with torch's global switches
restored afterwards. The Ray GRPO pair is in tests/distributed/test_ray_determinism.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import torch_determinism_restored

TEMPLATE = "User: {}\nAssistant: "


def sft(assets, save: Path) -> list[str]:
    return ["--pretrain", str(assets.model_dir), "--dataset", str(assets.sft_train), "--input_key", "question",
            "--output_key", "response", "--input_template", TEMPLATE, "--max_len", "48", "--max_samples", "16",
            "--train_batch_size", "8", "--micro_train_batch_size", "2", "--learning_rate", "1e-3",
            "--save_path", str(save), "--disable_progress_bar", "--full_determinism"]


def dpo(assets, save: Path) -> list[str]:
    return ["--pretrain", str(assets.model_dir), "--dataset", str(assets.pref_train), "--prompt_key", "prompt",
            "--input_template", TEMPLATE, "--max_len", "64", "--max_samples", "16", "--train_batch_size", "8",
            "--micro_train_batch_size", "4", "--learning_rate", "1e-3", "--save_path", str(save),
            "--disable_progress_bar", "--train.full_determinism_enable"]


def assert_bit_identical(a: Path, b: Path) -> None:
    first, second = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first), [k for k in first if not torch.equal(first[k],
                                                                                                      second[k])]


@pytest.mark.parametrize("kind", ["sft", "dpo"])
def test_two_flagged_runs_give_bit_identical_weights(kind, demo_assets, tmp_path, world_of_one):
    from rlhfkit.cli import train_dpo, train_sft

    main, argv = {"sft": (train_sft.main, sft), "dpo": (train_dpo.main, dpo)}[kind]
    for threads, name in ((2, "a"), (1, "b")):
        with torch_determinism_restored():
            torch.set_num_threads(threads)
            assert main(argv(demo_assets, tmp_path / name)) in (0, None)
    assert_bit_identical(tmp_path / "a", tmp_path / "b")
