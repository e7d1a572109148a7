"""SFT end to end on the tiny model: multi-rank equivalence, packing, exact resume, loadable output."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import run_here, run_module

TEMPLATE = "User: {}\nAssistant: "


def sft_args(assets, save: Path, *extra: str) -> list[str]:
    return ["rlhfkit.cli.train_sft", "--pretrain", str(assets.model_dir), "--dataset", str(assets.sft_train),
            "--input_key", "question", "--output_key", "response", "--input_template", TEMPLATE,
            "--max_len", "48", "--max_samples", "64", "--max_epochs", "1", "--train_batch_size", "8",
            "--micro_train_batch_size", "2",
            "--learning_rate", "1e-3", "--lr_warmup_ratio", "0.1", "--save_path", str(save),
            "--metrics_path", str(save / "metrics.jsonl"), "--disable_progress_bar", *extra]


def losses(save: Path) -> list[float]:
    lines = (save / "metrics.jsonl").read_text().splitlines()
    return [json.loads(x)["train/loss"] for x in lines if "train/loss" in x]


def check(proc) -> None:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.fixture(scope="module")
def one_rank_curve(demo_assets, tmp_path_factory):
    save = tmp_path_factory.mktemp("sft1")
    check(run_here(sft_args(demo_assets, save, "--zero_stage", "2"), None))
    return save, losses(save)


def test_one_rank_learns_and_saves_a_loadable_model(one_rank_curve, demo_assets):
    save, curve = one_rank_curve
    assert len(curve) == 8  # 64 samples / 8 per step
    assert all(map(lambda x: x == x, curve)) and curve[-1] < curve[0] - 0.5
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(save)
    tok = AutoTokenizer.from_pretrained(save)
    ids = tok(TEMPLATE.format("What is 1+2?"), return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out.shape[1] > ids.shape[1]


def test_muon_trains_and_its_loss_falls(one_rank_curve, demo_assets, tmp_path, world_of_one):
    """--optim muon (OpenRLHF's spelling, its default --muon.lr 0.02): the hidden matrices on Muon, the rest on
    AdamW at --learning_rate; it learns as the AdamW run does."""
    from rlhfkit.cli.train_sft import main

    assert main(sft_args(demo_assets, tmp_path, "--optim", "muon")[1:]) in (0, None)  # in process: no start-up
    curve = losses(tmp_path)
    assert len(curve) == 8 and all(map(lambda x: x == x, curve))
    assert curve[-1] < curve[0] - 0.5, (curve, one_rank_curve[1])


def test_torchrun_two_ranks_zero2_matches_one_rank(one_rank_curve, demo_assets, tmp_path):
    _, reference = one_rank_curve
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
                "127.0.0.1", "--master_port", str(_port()), "-m"]
    check(run_module(sft_args(demo_assets, tmp_path, "--zero_stage", "2"), launcher=launcher))
    assert losses(tmp_path) == pytest.approx(reference, rel=1e-5, abs=1e-6)


def test_torchrun_two_ranks_zero3_token_budget_matches_one_rank(one_rank_curve, demo_assets, tmp_path):
    """--use_dynamic_batch over two ZeRO-3 ranks: every rank runs the same number of forwards (fillers where a rank
    has fewer micro-batches), and as the loss is weighted by the step's totals the curve is the fixed one's."""
    _, reference = one_rank_curve
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
                "127.0.0.1", "--master_port", str(_port()), "-m"]
    check(run_module(sft_args(demo_assets, tmp_path, "--zero_stage", "3", "--use_dynamic_batch",
                              "--max_tokens_per_gpu", "100"), launcher=launcher))
    assert losses(tmp_path) == pytest.approx(reference, rel=1e-5, abs=1e-6)


def eval_losses(save: Path) -> list[float]:
    lines = (save / "metrics.jsonl").read_text().splitlines()
    return [json.loads(x)["eval/loss"] for x in lines if "eval/loss" in x]


def test_torchrun_two_ranks_zero3_odd_eval_set_matches_one_rank(demo_assets, tmp_path, capsys):
    """An eval set of 5 samples over 2 ZeRO-3 ranks with micro batches of 2: rank 0 holds 3 samples (2 batches), rank
    1 holds 2 (1 batch), so rank 1 runs one padding forward (a ZeRO-3 forward is collective) that the metric leaves
    out; the eval loss is the one-rank run's."""
    records = demo_assets.read("sft_eval")[:5]
    evalset = tmp_path / "eval5.jsonl"
    evalset.write_text("".join(json.dumps(r) + "\n" for r in records))
    extra = ("--zero_stage", "3", "--eval_dataset", str(evalset), "--eval_steps", "1", "--max_steps", "2")
    one, two = tmp_path / "one", tmp_path / "two"
    check(run_here(sft_args(demo_assets, one, *extra), capsys))
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
                "127.0.0.1", "--master_port", str(_port()), "-m"]
    check(run_module(sft_args(demo_assets, two, *extra), launcher=launcher, timeout=600))
    reference = eval_losses(one)
    assert len(reference) == 2 and all(0 < x < 20 for x in reference)
    assert eval_losses(two) == pytest.approx(reference, rel=1e-5, abs=1e-6)


def test_deepspeed_launcher_two_ranks_zero3_matches_one_rank(one_rank_curve, demo_assets, tmp_path):
    _, reference = one_rank_curve
    deepspeed = shutil.which("deepspeed", path=str(Path(sys.executable).parent))
    launcher = [deepspeed, "--num_gpus", "2", "--master_addr", "127.0.0.1", "--master_port", str(_port()),
                "--module"]
    check(run_module(sft_args(demo_assets, tmp_path, "--zero_stage", "3"), launcher=launcher))
    assert losses(tmp_path) == pytest.approx(reference, rel=1e-5, abs=1e-6)


def test_resume_continues_exactly(one_rank_curve, demo_assets, tmp_path, capsys):
    _, reference = one_rank_curve
    ckpt = tmp_path / "ckpt"
    first = tmp_path / "first"
    check(run_here(sft_args(demo_assets, first, "--zero_stage", "2", "--ckpt_path", str(ckpt),
                            "--save_steps", "3", "--max_steps", "3"), capsys))
    assert (ckpt / "latest").read_text() == "global_step3"
    second = tmp_path / "second"
    check(run_here(sft_args(demo_assets, second, "--zero_stage", "2", "--ckpt_path", str(ckpt),
                            "--save_steps", "3", "--load_checkpoint"), capsys))
    assert losses(first) == pytest.approx(reference[:3], abs=1e-6)
    assert losses(second) == pytest.approx(reference[3:], abs=1e-6)


def test_packed_batch_gives_the_same_per_sample_losses(demo_assets):
    from rlhfkit.data.collate import pack_collate, pad_collate
    from rlhfkit.data.readers import load_records
    from rlhfkit.data.sft_dataset import SFTDataset
    from rlhfkit.models.loading import load_causal_lm, load_tokenizer
    from rlhfkit.models.policy import sequence_token_logprobs

    tok = load_tokenizer(str(demo_assets.model_dir))
    model = load_causal_lm(str(demo_assets.model_dir)).eval()
    records = load_records(str(demo_assets.sft_train), max_samples=6)
    data = SFTDataset(records, tok, max_len=48, input_key="question", output_key="response",
                      input_template=TEMPLATE)
    samples = [data[i] for i in range(len(data))]

    def per_sample(batch, row_of, sample_of):
        with torch.no_grad():
            logp = sequence_token_logprobs(model, batch)
        mask = batch["loss_mask"][:, 1:].bool()
        out = []
        for i in range(len(samples)):
            sel = mask[row_of(i)] & sample_of(i)
            out.append(-logp[row_of(i)][sel].mean())
        return torch.stack(out)

    padded = pad_collate(samples, tok.pad_token_id)
    packed = pack_collate(samples)
    plain = per_sample(padded, lambda i: i, lambda i: torch.ones_like(padded["input_ids"][i, 1:], dtype=bool))
    sid = packed["sample_ids"][0, 1:]
    together = per_sample(packed, lambda i: 0, lambda i: sid == i)
    assert packed["input_ids"].shape[0] == 1 and len(samples) == 6
    torch.testing.assert_close(together, plain, atol=1e-4, rtol=0)


def _port() -> int:
    from rlhfkit.distributed.launch import free_port

    return free_port()
