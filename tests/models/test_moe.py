"""--aux_loss_coef: SFT, DPO and the RL actor add coef x the router load-balancing loss of a mixture-of-experts
model (recomputed here in float64 from the router logits), 0 leaves the loss unchanged, and a dense model or
packed batches fail with one line before anything starts."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from rlhfkit.config.common import StrategyArgs
from rlhfkit.distributed.strategy import DeepSpeedStrategy
from tests.helpers import error_lines

VOCAB = 64
COEF = 0.37


def tiny_tokenizer(path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", pad_token="w1", eos_token="w2",
                            bos_token="w3").save_pretrained(path)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    """A random-init Mixtral-shaped model (4 experts, top-2, 2 layers: about 60K parameters) with a tokenizer."""
    from transformers import MixtralConfig, MixtralForCausalLM

    path = tmp_path_factory.mktemp("tiny_moe")
    config = MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                           max_position_embeddings=128, pad_token_id=1, eos_token_id=2, bos_token_id=3)
    torch.manual_seed(0)
    MixtralForCausalLM(config).save_pretrained(path)
    tiny_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory):
    from transformers import LlamaConfig

    path = tmp_path_factory.mktemp("tiny_dense")
    LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=4, num_key_value_heads=2).save_pretrained(path)
    return path


def load(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def padded_batch(rows: list[list[int]], prompt_len: int) -> dict[str, torch.Tensor]:
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), 1, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(r)
        mask[i, :len(r)] = 1
    loss_mask = mask.clone()
    loss_mask[:, :prompt_len] = 0
    return {"input_ids": ids, "attention_mask": mask, "loss_mask": loss_mask}


def reference_aux(model, batch) -> float:
    """Switch Transformer load balancing (Fedus et al. 2021, eqs. 4-6) in float64 over the real tokens of every
    MoE layer: E x sum_e (share of top-k assignments to e) x (mean router probability of e)."""
    with torch.no_grad():
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], output_router_logits=True)
    real = batch["attention_mask"].reshape(-1).bool()
    experts, top_k = model.config.num_local_experts, model.config.num_experts_per_tok
    probs = torch.cat([layer.double().softmax(-1)[real] for layer in out.router_logits])  # [layers x tokens, E]
    chosen = torch.zeros_like(probs).scatter_(1, probs.topk(top_k, dim=-1).indices, 1.0)
    return float(experts * (chosen.mean(0) * probs.mean(0)).sum())


def reference_ce(model, batch) -> float:
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.double()
    logp = logits[:, :-1].log_softmax(-1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
    mask = batch["loss_mask"][:, 1:].double()
    return float(-(logp * mask).sum() / mask.sum())


def rows(seed: int, n: int, lengths: list[int]) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, VOCAB, (lengths[i % len(lengths)],), generator=g).tolist() for i in range(n)]


def strategy() -> DeepSpeedStrategy:
    return DeepSpeedStrategy(StrategyArgs(zero_stage=0, train_batch_size=2, micro_train_batch_size=2))


def test_sft_loss_adds_coef_times_router_loss(moe_dir):
    from rlhfkit.trainers.sft import SFTTrainer

    model = load(moe_dir)
    batch = padded_batch(rows(0, 3, [9, 6, 11]), prompt_len=3)
    expected_ce, expected_aux = reference_ce(model, batch), reference_aux(model, batch)
    assert expected_aux > 1.0  # evenly spread routing gives top_k = 2; the untrained router is uneven

    def micro_loss(coef):
        trainer = SFTTrainer(strategy(), model, None, [], None, None, max_epochs=1, max_steps=-1,
                             logging_args=None, ckpt_args=None, logger=None, aux_loss_coef=coef)
        return trainer.micro_loss(batch)

    loss, ce, aux = micro_loss(COEF)
    assert aux is not None and aux.requires_grad
    assert aux.item() == pytest.approx(expected_aux, rel=1e-5)
    assert ce.item() == pytest.approx(expected_ce, rel=1e-5)
    assert loss.item() == pytest.approx(expected_ce + COEF * expected_aux, rel=1e-5)
    plain, plain_ce, plain_aux = micro_loss(0.0)
    assert plain_aux is None and plain.item() == plain_ce.item() == pytest.approx(expected_ce, rel=1e-5)
    assert model.config.output_router_logits is False  # the switch is put back after the forward


def test_dpo_loss_adds_coef_times_router_loss(moe_dir):
    from rlhfkit.trainers.dpo import DPOTrainer, FrozenReference

    policy, ref = load(moe_dir), load(moe_dir)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn_like(p) * 0.02)  # policy != reference, so the DPO term is not log 2 exactly
    batch = padded_batch(rows(1, 4, [8, 10, 7, 9]), prompt_len=3)  # 2 chosen rows, then 2 rejected rows
    batch["margin"] = torch.zeros(2)
    expected_aux = reference_aux(policy, batch)

    def loss(coef):
        s = strategy()
        trainer = DPOTrainer(s, policy, None, [], None, None, max_epochs=1, max_steps=-1, logging_args=None,
                             ckpt_args=None, logger=None, aux_loss_coef=coef, reference=FrozenReference(s, ref),
                             beta=0.1)
        return trainer.loss(batch)

    with_aux, sums = loss(COEF)
    without, plain_sums = loss(0.0)
    assert sums["aux_loss"][0] / sums["aux_loss"][1] == pytest.approx(expected_aux, rel=1e-5)
    assert with_aux.item() == pytest.approx(without.item() + COEF * expected_aux, rel=1e-5)
    preference = plain_sums["preference_loss"][0] / plain_sums["preference_loss"][1]
    assert without.item() == pytest.approx(preference, rel=1e-6) and "aux_loss" not in plain_sums


def test_rl_actor_loss_adds_coef_times_router_loss(moe_dir, world_of_one):
    from rlhfkit.config.rl import PPOConfig
    from rlhfkit.config.rl_specs import actor_spec
    from rlhfkit.rl.experience import Experience
    from rlhfkit.rl.roles import ActorRole

    batch = padded_batch(rows(2, 2, [10, 7]), prompt_len=4)
    exp = Experience(sequences=batch["input_ids"], attention_mask=batch["attention_mask"],
                     prompt_lengths=torch.tensor([4, 4]),
                     action_mask=batch["attention_mask"][:, 4:].clone(),
                     advantages=torch.tensor([[0.5] * 6, [-1.0] * 6]))
    expected_aux = reference_aux(load(moe_dir), batch)

    def train(coef):
        cfg = PPOConfig()
        cfg.model.pretrain = str(moe_dir)
        cfg.strategy.zero_stage, cfg.strategy.train_batch_size, cfg.strategy.micro_train_batch_size = 0, 2, 2
        cfg.algo.aux_loss_coef = coef
        actor = ActorRole(actor_spec(cfg), num_update_steps=1)
        exp.action_log_probs = actor.log_probs(exp)
        return actor.train(copy.copy(exp))

    metrics = train(COEF)
    assert metrics["aux_loss"] == pytest.approx(expected_aux, rel=1e-5)
    assert metrics["loss"] == pytest.approx(metrics["policy_loss"] + COEF * expected_aux, rel=1e-5)
    plain = train(0.0)
    assert "aux_loss" not in plain and plain["loss"] == pytest.approx(plain["policy_loss"], rel=1e-6)
    assert plain["policy_loss"] == pytest.approx(metrics["policy_loss"], rel=1e-5)


def one_line_error(capsys, main, argv, prog) -> str:
    from rlhfkit.cli.common import run_cli

    code = run_cli(main, argv, prog=prog)
    err = error_lines(capsys.readouterr().err)
    assert code == 2 and len(err) == 1 and "Traceback" not in err[0], err
    return err[0]


def test_dense_model_or_packing_fails_with_one_line(capsys, moe_dir, dense_dir, tmp_path):
    from rlhfkit.cli.train_dpo import main as dpo_main
    from rlhfkit.cli.train_sft import main as sft_main

    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"input": "w5 w6", "output": "w7", "chosen": "w7", "rejected": "w8"}) + "\n")
    common = ["--dataset", str(data), "--train_batch_size", "1", "--micro_train_batch_size", "1"]
    line = one_line_error(capsys, sft_main, ["--pretrain", str(dense_dir), *common, "--aux_loss_coef", "0.01"],
                          "train_sft")
    assert "--aux_loss_coef" in line and "mixture-of-experts" in line and "llama" in line
    line = one_line_error(capsys, dpo_main, ["--pretrain", str(dense_dir), *common, "--aux_loss_coef", "0.01"],
                          "train_dpo")
    assert "mixture-of-experts" in line
    line = one_line_error(capsys, sft_main, ["--pretrain", str(moe_dir), *common, "--aux_loss_coef", "0.01",
                                             "--packing_samples"], "train_sft")
    assert "--packing_samples" in line
    line = one_line_error(capsys, sft_main, ["--pretrain", str(moe_dir), *common, "--aux_loss_coef", "-1"],
                          "train_sft")
    assert ">= 0" in line
