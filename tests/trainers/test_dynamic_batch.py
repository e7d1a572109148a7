"""Token-budget micro-batches (`--use_dynamic_batch --max_tokens_per_gpu`): an optimizer step's gradient equals the
fixed-micro-batch gradient (fp32, 1e-5) for SFT and for the RL actor and critic, padded and packed.

Gradients are read by a pre-step hook on the optimizer inside the real DeepSpeed engine (ZeRO-0, world of one,
clipping off), i.e. after the engine accumulated every micro-batch of the step."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from rlhfkit.config.common import CheckpointArgs, LoggingArgs, StrategyArgs
from rlhfkit.rl.experience import experience_from_samples
from rlhfkit.rollout.engine import SampledSequence

TOL = {"atol": 1e-5, "rtol": 0.0}
LENGTHS = [(4, 2), (30, 28), (3, 6), (2, 2), (25, 20), (8, 4), (3, 2), (20, 10)]  # (prompt, response): skewed


class GradientAtStep:
    """Copies the gradients of `params` when an optimizer is about to step."""

    def __init__(self, named_params):
        self.params = dict(named_params)
        self.grads: dict[str, torch.Tensor] = {}

    def __enter__(self):
        def hook(*_):
            self.grads = {n: p.grad.detach().clone() for n, p in self.params.items() if p.grad is not None}

        from torch.optim.optimizer import register_optimizer_step_pre_hook

        self.handle = register_optimizer_step_pre_hook(hook)
        return self

    def __exit__(self, *exc):
        self.handle.remove()


def assert_same_grads(got: dict, expected: dict) -> None:
    assert got.keys() == expected.keys() and len(expected) > 10
    assert max(float(g.abs().max()) for g in expected.values()) > 1e-4
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], **TOL, msg=name)


def strategy_args(micro: int, budget: int | None) -> StrategyArgs:
    return StrategyArgs(zero_stage=0, train_batch_size=8, micro_train_batch_size=micro, max_norm=0.0,
                        use_dynamic_batch=budget is not None, max_tokens_per_gpu=budget)


# -- SFT ---------------------------------------------------------------------------------------------------------
def sft_samples(vocab: int) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for prompt, response in LENGTHS:
        ids = torch.randint(3, vocab, (prompt + response,), generator=gen)
        out.append({"input_ids": ids, "loss_mask": torch.cat([torch.zeros(prompt), torch.ones(response)]).long()})
    return out


def sft_step(demo_assets, samples, micro: int, budget: int | None, packing: bool):
    from rlhfkit.data.collate import make_collate
    from rlhfkit.distributed.strategy import DeepSpeedStrategy
    from rlhfkit.models.loading import load_causal_lm
    from rlhfkit.trainers.sft import SFTTrainer

    strategy = DeepSpeedStrategy(strategy_args(micro, budget))
    strategy.setup_distributed()
    model = load_causal_lm(str(demo_assets.model_dir), dtype=torch.float32)
    engine = strategy.prepare_train(model, 1e-3, 10)
    trainer = SFTTrainer(strategy, engine, None, samples, None, make_collate(0, packing=packing), max_epochs=1,
                         max_steps=-1, logging_args=LoggingArgs(), ckpt_args=CheckpointArgs(), logger=None,
                         packing=packing)
    batch = list(range(len(samples)))
    micro_batches = trainer.step_micro_batches(batch)
    with GradientAtStep(model.named_parameters()) as grads:
        metrics = trainer.train_batch(micro_batches, time.perf_counter(), batch)
    return grads.grads, micro_batches, metrics["loss"]


def test_sft_step_gradient_is_the_same_with_a_token_budget(demo_assets, restore_env):
    from rlhfkit.models.loading import load_causal_lm

    model = load_causal_lm(str(demo_assets.model_dir), dtype=torch.float32)
    samples = sft_samples(model.config.vocab_size)
    # Independent reference: one forward of every sample, the mean NLL over all target tokens of the step.
    ids = torch.nn.utils.rnn.pad_sequence([s["input_ids"] for s in samples], batch_first=True)
    target = torch.nn.utils.rnn.pad_sequence([s["loss_mask"] for s in samples], batch_first=True)[:, 1:].bool()
    attention = torch.nn.utils.rnn.pad_sequence([torch.ones_like(s["input_ids"]) for s in samples], batch_first=True)
    logp = torch.log_softmax(model(input_ids=ids, attention_mask=attention).logits[:, :-1].double(), -1)
    nll = -logp.gather(-1, ids[:, 1:, None])[..., 0]
    loss = nll[target].sum() / target.sum()
    loss.backward()
    expected = {n: p.grad.float() for n, p in model.named_parameters()}

    fixed, fixed_micro, fixed_loss = sft_step(demo_assets, samples, 2, None, packing=False)
    assert fixed_micro == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert_same_grads(fixed, expected)
    assert fixed_loss == pytest.approx(float(loss.detach()), abs=1e-6)
    for packing in (False, True):
        got, micro, step_loss = sft_step(demo_assets, samples, 2, 64, packing)
        assert sorted(i for m in micro for i in m) == list(range(8)) and micro != fixed_micro
        assert_same_grads(got, expected)
        assert step_loss == pytest.approx(float(loss.detach()), abs=1e-6)


# -- RL ----------------------------------------------------------------------------------------------------------
def rl_experience(vocab: int):
    gen = torch.Generator().manual_seed(3)
    samples = []
    for prompt, response in LENGTHS:
        ids = torch.randint(3, vocab, (prompt + response,), generator=gen).tolist()
        samples.append(SampledSequence(ids[:prompt], ids[prompt:], [-1.0] * response, "stop"))
    exp = experience_from_samples(samples, pad_id=0)
    shape = exp.action_mask.shape
    exp.action_log_probs = -2.0 + 0.3 * torch.randn(shape, generator=gen)
    exp.advantages = torch.randn(shape, generator=gen)
    exp.values = torch.randn(shape, generator=gen)
    exp.returns = torch.randn(shape, generator=gen)
    return exp


def rl_config(demo_assets, micro: int, budget: int | None, packing: bool, agg: str):
    from rlhfkit.config.rl import PPOConfig

    cfg = PPOConfig()
    cfg.model.pretrain = str(demo_assets.model_dir)
    cfg.strategy = strategy_args(micro, budget)
    cfg.data = dataclasses.replace(cfg.data, packing_samples=packing, prompt_max_len=32, generate_max_len=32)
    cfg.algo.policy_loss_agg = agg
    return cfg


def rl_step_grads(demo_assets, exp, micro: int, budget: int | None, packing: bool, agg: str):
    from rlhfkit.config.rl_specs import actor_spec, critic_spec
    from rlhfkit.rl.roles import ActorRole, CriticRole

    cfg = rl_config(demo_assets, micro, budget, packing, agg)
    out = {}
    for name, role in (("actor", ActorRole(actor_spec(cfg), 10)), ("critic", CriticRole(critic_spec(cfg), 10))):
        with GradientAtStep(role.engine.module.named_parameters()) as grads:
            role.train(exp.to_dict(), seed=0)
        out[name] = grads.grads
    return out


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean"])
def test_rl_actor_and_critic_gradients_are_the_same_with_a_token_budget(demo_assets, restore_env, agg):
    from transformers import AutoConfig

    exp = rl_experience(AutoConfig.from_pretrained(demo_assets.model_dir).vocab_size)
    one_batch = rl_step_grads(demo_assets, exp, 8, None, False, agg)  # the whole step in one micro-batch
    runs = [rl_step_grads(demo_assets, exp, 2, None, False, agg), rl_step_grads(demo_assets, exp, 2, 64, False, agg),
            rl_step_grads(demo_assets, exp, 2, 64, True, agg)]
    for run in runs:
        for role in ("actor", "critic"):
            assert_same_grads(run[role], one_batch[role])


# -- reward model (the preference trainers' loop) ------------------------------------------------------------------
def rm_step(demo_assets, pairs, micro: int, budget: int | None, packing: bool):
    from functools import partial

    from rlhfkit.data.collate import pair_collate
    from rlhfkit.distributed.strategy import DeepSpeedStrategy
    from rlhfkit.models.value_model import load_value_model
    from rlhfkit.trainers.reward import RewardModelTrainer

    strategy = DeepSpeedStrategy(strategy_args(micro, budget))
    strategy.setup_distributed()
    torch.manual_seed(0)  # the same random value head in every run
    model = load_value_model(str(demo_assets.model_dir), dtype=torch.float32, require_head=False)
    engine = strategy.prepare_train(model, 1e-3, 10)
    trainer = RewardModelTrainer(strategy, engine, None, pairs, None, partial(pair_collate, pad_id=0, packing=packing),
                                 max_epochs=1, max_steps=-1, logging_args=LoggingArgs(), ckpt_args=CheckpointArgs(),
                                 logger=None, packing=packing)
    batch = list(range(len(pairs)))
    micro_batches = trainer.step_micro_batches(batch)
    with GradientAtStep(model.named_parameters()) as grads:
        metrics = trainer.train_batch(micro_batches, time.perf_counter(), batch)
    return grads.grads, micro_batches, metrics["loss"]


def test_reward_model_step_gradient_is_the_same_with_a_token_budget(demo_assets, restore_env):
    gen = torch.Generator().manual_seed(4)
    pairs = [{"prompt_ids": torch.randint(3, 1000, (p,), generator=gen),
              "chosen_ids": torch.randint(3, 1000, (r,), generator=gen),
              "rejected_ids": torch.randint(3, 1000, (r // 2 + 1,), generator=gen), "margin": 0.0}
             for p, r in LENGTHS]
    expected, _, loss = rm_step(demo_assets, pairs, 8, None, packing=False)  # the whole step in one micro-batch
    for micro, budget, packing in ((2, None, False), (2, 128, False), (2, 128, True)):
        got, micro_batches, step_loss = rm_step(demo_assets, pairs, micro, budget, packing)
        if budget:
            assert sorted(i for m in micro_batches for i in m) == list(range(8))
            assert sorted(map(len, micro_batches)) != [2, 2, 2, 2]  # uneven micro-batches, weighted by their pairs
        assert_same_grads(got, expected)
        assert step_loss == pytest.approx(loss, abs=1e-6)
