"""KTO in-process on the tiny demo model: it widens the desirable-vs-undesirable log-prob gap, its first step is
the closed form, and its KL reference point comes from mismatched prompt/completion pairs."""

from __future__ import annotations

import json

import pytest
import torch

TEMPLATE = "User: {}\nAssistant: "




def run(assets, save, *extra: str):
    from rlhfkit.config.base import parse_config
    from rlhfkit.config.preference import KTOConfig
    from rlhfkit.trainers.kto import run_kto

    argv = ["--pretrain", str(assets.model_dir), "--dataset", str(assets.kto_train), "--input_key", "prompt",
            "--output_key", "completion", "--label_key", "label", "--input_template", TEMPLATE, "--max_len", "64",
            "--train_batch_size", "32", "--micro_train_batch_size", "16", "--learning_rate", "1e-3",
            "--zero_stage", "0", "--save_path", str(save), "--disable_progress_bar", "--logging_steps", "1", *extra]
    return run_kto(parse_config(KTOConfig, argv, "test"))


def test_kto_widens_the_desirable_undesirable_gap(max_assets, tmp_path, restore_env):
    from rlhfkit.trainers.kto import labelled_logp_gap

    trainer = run(max_assets, tmp_path, "--max_samples", "768", "--packing_samples", "--eval_dataset",
                  str(max_assets.kto_eval))
    held_out = [json.loads(line) for line in open(max_assets.kto_eval)]
    before = labelled_logp_gap(str(max_assets.model_dir), held_out, input_template=TEMPLATE)
    after = labelled_logp_gap(str(tmp_path), held_out, input_template=TEMPLATE)
    assert after > before + 1.0, (before, after)
    ev = trainer.last_eval
    assert ev["desirable_logps"] - ev["undesirable_logps"] == pytest.approx(after, abs=1e-3)
    assert ev["desirable_reward"] > ev["undesirable_reward"]
    assert trainer.history[0]["loss"] == pytest.approx(0.5, abs=1e-5)  # policy == reference: 1 - sigmoid(0)


def test_first_step_is_the_weighted_closed_form(max_assets, tmp_path, restore_env):
    rows = [{"prompt": f"Which is largest: {i}, {i + 1}?", "completion": str(i + (i % 3 != 0)),
             "label": i % 3 != 0} for i in range(8)]  # 5 desirable, 3 undesirable
    data = tmp_path / "kto.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    trainer = run(max_assets, tmp_path / "out", "--dataset", str(data), "--train_batch_size", "8",
                  "--micro_train_batch_size", "4", "--desirable_loss_weight", "1.0", "--undesirable_loss_weight",
                  "3.0", "--max_steps", "1")
    first = trainer.history[0]
    assert first["kto_loss"] == pytest.approx(0.5 * (5 * 1.0 + 3 * 3.0) / 8, rel=1e-5)
    assert first["kl"] == pytest.approx(0.0, abs=1e-6)


def test_kl_reference_point_uses_mismatched_pairs(max_assets):
    from rlhfkit.config.common import StrategyArgs
    from rlhfkit.data.collate import unpaired_collate
    from rlhfkit.data.preference_dataset import UnpairedDataset
    from rlhfkit.distributed.strategy import DeepSpeedStrategy
    from rlhfkit.models.loading import load_causal_lm, load_tokenizer
    from rlhfkit.trainers.kto import KTOTrainer
    from rlhfkit.trainers.preference import FrozenReference

    tok = load_tokenizer(str(max_assets.model_dir))
    recs = [json.loads(line) for line in open(max_assets.kto_eval)][:4]
    data = UnpairedDataset(recs, tok, 64, input_key="prompt", output_key="completion", input_template=TEMPLATE)
    samples = [data[i] for i in range(4)]
    base = load_causal_lm(str(max_assets.model_dir)).eval()
    other = load_causal_lm(str(max_assets.model_dir)).eval()
    torch.manual_seed(3)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.05 * torch.randn_like(p))

    def logp(model, prompt_ids, response_ids):
        ids = torch.cat([prompt_ids, response_ids])[None]
        with torch.no_grad():
            lp = torch.log_softmax(model(ids).logits[0, :-1].double(), -1)
        start = prompt_ids.numel() - 1
        return lp[torch.arange(start, ids.shape[1] - 1), ids[0, start + 1:]].sum().item()

    def kl_estimate(policy, ref):  # prompt i with the completion of sample i-1
        pairs = [(samples[i]["prompt_ids"], samples[i - 1]["response_ids"]) for i in range(4)]
        return sum(logp(policy, *p) - logp(ref, *p) for p in pairs) / 4

    policy, ref = (base, other) if kl_estimate(base, other) > 0 else (other, base)
    expected = kl_estimate(policy, ref)
    assert expected > 0
    strategy = DeepSpeedStrategy(StrategyArgs(zero_stage=0, train_batch_size=4, micro_train_batch_size=4))
    trainer = KTOTrainer(strategy, policy, tok, [], None, None, max_epochs=1, max_steps=-1, logging_args=None,
                         ckpt_args=None, logger=None, reference=FrozenReference(strategy, ref), beta=0.1)
    with torch.no_grad():
        _, sums = trainer.loss(unpaired_collate(samples, tok.pad_token_id, kl_rows=True, max_len=64))
    assert sums["kl"][0] / sums["kl"][1] == pytest.approx(expected, rel=1e-4)
