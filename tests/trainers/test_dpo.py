"""DPO/IPO/cDPO in-process on the tiny demo model: held-out implicit-reward accuracy, closed-form first steps,
SimPO and ORPO from the CLI without a reference model, exact packing, the offloaded ZeRO-3 reference, and a 2-rank
ZeRO-3 torchrun run."""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch

from tests.helpers import run_module

TEMPLATE = "User: {}\nAssistant: "




def dpo_args(assets, save, *extra: str) -> list[str]:
    return ["--pretrain", str(assets.model_dir), "--dataset", str(assets.pref_train), "--prompt_key", "prompt",
            "--input_template", TEMPLATE, "--max_len", "64", "--train_batch_size", "16",
            "--micro_train_batch_size", "16", "--learning_rate", "1e-3", "--zero_stage", "0", "--packing_samples",
            "--save_path", str(save), "--disable_progress_bar", "--logging_steps", "1", *extra]


def run(assets, save, *extra: str):
    from rlhfkit.config.base import parse_config
    from rlhfkit.config.preference import DPOConfig
    from rlhfkit.trainers.dpo import run_dpo

    return run_dpo(parse_config(DPOConfig, dpo_args(assets, save, *extra), "test"))


@pytest.fixture(scope="module")
def trained(max_assets, tmp_path_factory, restore_env):
    save = tmp_path_factory.mktemp("dpo")
    return run(max_assets, save, "--eval_dataset", str(max_assets.pref_eval), "--max_samples", "1024"), save


def test_implicit_reward_accuracy_on_held_out_pairs(trained, max_assets):
    from rlhfkit.trainers.reward import preference_accuracy

    trainer, save = trained
    held_out = [json.loads(line) for line in open(max_assets.pref_eval)]
    accuracy = preference_accuracy(str(save), held_out, ref_model_or_path=str(max_assets.model_dir),
                                   input_template=TEMPLATE)
    assert accuracy >= 0.75
    assert trainer.last_eval["acc"] == pytest.approx(accuracy, abs=0.006)
    assert trainer.last_eval["margin"] > 0 and trainer.last_eval["chosen_reward"] > trainer.last_eval[
        "rejected_reward"]
    losses = [h["loss"] for h in trainer.history]
    assert losses[0] == pytest.approx(math.log(2), abs=1e-4)  # the policy starts equal to its reference
    assert sum(losses[-4:]) / 4 < losses[0] - 0.05


@pytest.mark.parametrize("flags, expected", [
    ((), math.log(2)),                                 # DPO: -log sigmoid(0)
    (("--label_smoothing", "0.2"), math.log(2)),       # cDPO: -(0.8 + 0.2) log sigmoid(0)
    (("--ipo", "--beta", "0.1"), 25.0),                # IPO: (0 - 1 / (2 beta))^2
])
def test_first_step_loss_is_the_closed_form_at_policy_equal_reference(max_assets, tmp_path, restore_env, flags,
                                                                      expected):
    trainer = run(max_assets, tmp_path, "--train_batch_size", "8", "--micro_train_batch_size", "4",
                  "--max_steps", "1", "--max_samples", "64", *flags)
    first = trainer.history[0]
    assert first["preference_loss"] == pytest.approx(expected, rel=1e-5)
    assert first["margin"] == pytest.approx(0.0, abs=1e-6) and first["acc"] == 0.0


def test_nll_term_adds_the_chosen_token_nll(max_assets, tmp_path, restore_env):
    trainer = run(max_assets, tmp_path, "--train_batch_size", "8", "--micro_train_batch_size", "8",
                  "--max_steps", "1", "--max_samples", "64", "--nll_loss_coef", "0.5")
    first = trainer.history[0]
    assert first["nll_loss"] > 1.0  # a random-init model: several nats per token
    assert first["loss"] == pytest.approx(math.log(2) + 0.5 * first["nll_loss"], rel=1e-5)


@pytest.mark.parametrize("loss_type, extra", [("simpo", ("--beta", "2.0", "--simpo_gamma", "0.5")),
                                              ("orpo", ("--beta", "0.1"))])
def test_reference_free_losses_train_two_steps_from_the_cli_without_a_reference(max_assets, tmp_path, restore_env,
                                                                                monkeypatch, loss_type, extra):
    """`train_dpo --loss_type simpo|orpo` (the CLI, in this process) trains 2 steps and never builds a reference."""
    import rlhfkit.trainers.preference as preference
    from rlhfkit.cli.common import run_cli
    from rlhfkit.cli.train_dpo import main

    def no_reference(*args, **kwargs):
        raise AssertionError(f"--loss_type {loss_type} built a reference model")

    monkeypatch.setattr(preference, "load_reference", no_reference)
    monkeypatch.setattr(preference, "FrozenReference", no_reference)
    save = tmp_path / loss_type
    argv = dpo_args(max_assets, save, "--loss_type", loss_type, "--train_batch_size", "8",
                    "--micro_train_batch_size", "4", "--max_steps", "2", "--max_samples", "64", *extra)
    assert run_cli(main, argv, prog="train_dpo") == 0
    rows = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "train/loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert all(math.isfinite(v) for v in r.values())
        assert r["train/margin"] == pytest.approx(r["train/chosen_reward"] - r["train/rejected_reward"], abs=1e-5)
        if loss_type == "orpo":  # the chosen NLL plus 0.1 x a positive odds-ratio term, and nothing else
            assert r["train/nll_loss"] < r["train/loss"] == r["train/preference_loss"]
    assert (save / "model.safetensors").is_file()


def test_packed_and_padded_sequence_logps_agree(max_assets):
    from rlhfkit.data.collate import pair_collate
    from rlhfkit.data.preference_dataset import PreferenceDataset
    from rlhfkit.models.loading import load_causal_lm, load_tokenizer
    from rlhfkit.trainers.preference import sequence_logps

    tok = load_tokenizer(str(max_assets.model_dir))
    recs = [json.loads(line) for line in open(max_assets.pref_eval)][:5]
    data = PreferenceDataset(recs, tok, 64, prompt_key="prompt", input_template=TEMPLATE)
    pairs = [data[i] for i in range(len(data))]
    model = load_causal_lm(str(max_assets.model_dir)).eval()
    with torch.no_grad():
        padded = sequence_logps(model, pair_collate(pairs, tok.pad_token_id))
        packed = sequence_logps(model, pair_collate(pairs, tok.pad_token_id, packing=True, pad_to_multiple=8))
        # independent check of one sample: sum of log p over its response tokens
        p = pairs[0]
        ids = torch.cat([p["prompt_ids"], p["chosen_ids"]])[None]
        logp = torch.log_softmax(model(ids).logits[0, :-1].double(), -1)
        targets = ids[0, 1:]
        start = p["prompt_ids"].numel() - 1
        manual = logp[torch.arange(start, targets.numel()), targets[start:]].sum()
    torch.testing.assert_close(packed[0], padded[0], rtol=0, atol=1e-4)
    torch.testing.assert_close(packed[1], padded[1])
    assert padded[1][0].item() == p["chosen_ids"].numel()
    assert padded[0][0].item() == pytest.approx(manual.item(), abs=1e-4)


def test_pairs_run_their_prompt_once_with_the_plain_logps_and_gradients(max_assets, monkeypatch):
    """Chosen and rejected share the prompt: it runs once (`rlhfkit.models.shared_prefix`), and the log-prob sums
    and the parameter gradients are those of the plain padded forward."""
    from rlhfkit.data.collate import pair_collate
    from rlhfkit.data.preference_dataset import PreferenceDataset
    from rlhfkit.models import shared_prefix
    from rlhfkit.models.loading import load_causal_lm, load_tokenizer
    from rlhfkit.trainers import preference

    tok = load_tokenizer(str(max_assets.model_dir))
    recs = [json.loads(line) for line in open(max_assets.pref_eval)][:6]
    data = PreferenceDataset(recs, tok, 64, prompt_key="prompt", input_template=TEMPLATE)
    batch = pair_collate([data[i] for i in range(len(data))], tok.pad_token_id)
    model = load_causal_lm(str(max_assets.model_dir))
    calls = []
    original = preference.shared_prefix_logits
    monkeypatch.setattr(preference, "shared_prefix_logits", lambda *a, **k: calls.append(1) or original(*a, **k))

    def logps_and_grads():
        model.zero_grad()
        sums, counts, _ = preference.sequence_logps(model, batch)
        (sums * torch.linspace(0.5, 1.5, sums.numel())).sum().backward()
        return sums.detach(), counts, [p.grad.clone() for p in model.parameters()]

    shared = logps_and_grads()
    assert calls == [1]
    monkeypatch.setattr(shared_prefix, "MIN_SAVED_FRACTION", 2.0)  # never pays: the plain forward
    plain = logps_and_grads()
    assert calls == [1]
    torch.testing.assert_close(shared[0], plain[0], rtol=0, atol=1e-4)
    torch.testing.assert_close(shared[1], plain[1])
    for a, b in zip(shared[2], plain[2]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    monkeypatch.setattr(shared_prefix, "MIN_SAVED_FRACTION", 0.0)  # it would pay, but the device says plain
    monkeypatch.setattr(preference, "pair_prompts_share_a_pass", lambda device: False)
    torch.testing.assert_close(logps_and_grads()[0], plain[0])
    assert calls == [1]


def test_pair_prompts_share_a_pass_on_the_cpu_only():
    """On a GPU the preference step is launch-bound and the plain single pass is faster (H200, gpu_profile.md)."""
    from rlhfkit.trainers.preference import pair_prompts_share_a_pass

    assert pair_prompts_share_a_pass(torch.device("cpu"))
    assert not pair_prompts_share_a_pass(torch.device("cuda", 0))
    assert not pair_prompts_share_a_pass(torch.device("meta"))


def test_zero3_offloaded_reference_matches_plain_run(max_assets, tmp_path, restore_env):
    common = ("--train_batch_size", "8", "--micro_train_batch_size", "4", "--max_steps", "2", "--max_samples",
              "64")
    plain = run(max_assets, tmp_path / "plain", *common)
    offloaded = run(max_assets, tmp_path / "zero3", *common, "--zero_stage", "3", "--ref_offload")
    for a, b in zip(plain.history, offloaded.history):
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-4)
        assert b["margin"] == pytest.approx(a["margin"], abs=1e-4)


def test_torchrun_two_ranks_zero3_trains_and_saves(max_assets, tmp_path):
    from rlhfkit.distributed.launch import free_port

    save = tmp_path / "out"
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
                "127.0.0.1", "--master_port", str(free_port()), "-m"]
    args = ["rlhfkit.cli.train_dpo", *dpo_args(max_assets, save, "--zero_stage", "3", "--max_samples", "256",
                                               "--train_batch_size", "16", "--micro_train_batch_size", "4",
                                               "--ref_offload")]
    proc = run_module(args, launcher=launcher, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    losses = [r["train/loss"] for r in rows if "train/loss" in r]
    assert len(losses) == 16 and all(math.isfinite(x) for x in losses)
    assert losses[0] == pytest.approx(math.log(2), abs=1e-3)
    assert sum(losses[-4:]) / 4 < losses[0]
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(save).config.vocab_size > 0

