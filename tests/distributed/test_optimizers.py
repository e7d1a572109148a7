"""The optimizer module: Muon's step against a float64 hand computation of the Newton-Schulz iteration, which
parameters Muon takes, and every OpenRLHF optimizer flag read back from the built optimizer, schedule or engine."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from rlhfkit.config.base import parse_config
from rlhfkit.config.common import StrategyArgs
from rlhfkit.config.rl import PPOConfig
from rlhfkit.config.rl_specs import rl_specs
from rlhfkit.config.sft import SFTConfig
from rlhfkit.distributed import optimizers
from rlhfkit.distributed.optimizers import MuonWithAdamW, make_optimizer, make_scheduler, split_for_muon
from rlhfkit.distributed.plain_torch_engine import PlainTorchEngine
from rlhfkit.distributed.strategy import DeepSpeedStrategy
from rlhfkit.errors import UserError

NS = (3.4445, -4.775, 2.0315)  # torch's (Keller Jordan's) quintic Newton-Schulz coefficients
# torch runs the iteration in bfloat16 (8-bit mantissa) and the quintic's slope (up to 3.4) amplifies its rounding:
# the orthogonalised update agrees with float64 to about 4e-2 (exactly with the same polynomial in bfloat16, below)
BF16_TOL = 5e-2


def tiny_llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(config).float()


def newton_schulz_f64(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """X <- a X + (b A + c A^2) X with A = X X^T, from X = G / ||G||_F (the wide orientation), in float64."""
    a, b, c = NS
    x = g.double()
    tall = x.shape[0] > x.shape[1]
    x = (x.T if tall else x) / x.norm()
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


def muon_only(weight: torch.Tensor, **kw) -> torch.optim.Optimizer:
    return torch.optim.Muon([weight], **{"lr": 0.1, "weight_decay": 0.01, "momentum": 0.95, **kw})


def test_one_muon_step_is_the_hand_computed_newton_schulz_polynomial():
    """A diagonal gradient diag(3, 4) in a 2x3 weight: Newton-Schulz acts on its singular values alone, 0.6 and 0.8
    after the Frobenius normalisation, each through p(x) = a x + b x^3 + c x^5 five times (computed here by hand,
    in float64). Step: W <- W (1 - lr wd) - lr sqrt(max(1, rows / cols)) O, with O = diag(p^5(0.6), p^5(0.8))."""
    def p(x: float) -> float:
        a, b, c = NS
        return a * x + b * x**3 + c * x**5

    singular = []
    for x in (3 / 5, 4 / 5):
        for _ in range(5):
            x = p(x)
        singular.append(x)
    w0 = torch.arange(6, dtype=torch.float64).reshape(2, 3) / 10
    w = torch.nn.Parameter(w0.clone())
    w.grad = torch.tensor([[3.0, 0, 0], [0, 4.0, 0]], dtype=torch.float64)
    muon_only(w).step()
    expected = w0 * (1 - 0.1 * 0.01) - 0.1 * torch.tensor([[singular[0], 0, 0], [0, singular[1], 0]],
                                                          dtype=torch.float64)
    assert torch.allclose(w.detach(), expected, atol=0.1 * BF16_TOL)
    assert 0.6 < min(singular) and max(singular) < 1.3  # the iteration pushes both towards 1 (not exactly)
    # the remaining gap is bfloat16 rounding: the same polynomial with bfloat16 matrix products is torch's exactly
    for x0, got in ((3 / 5, w.detach()[0, 0]), (4 / 5, w.detach()[1, 1])):
        x = torch.tensor([[x0]], dtype=torch.bfloat16)
        for _ in range(5):
            gram = x @ x.T
            x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=NS[1], alpha=NS[2]), x, beta=NS[0])
        start = w0[0, 0] if x0 == 3 / 5 else w0[1, 1]
        assert float(got) == pytest.approx(float(start) * (1 - 0.1 * 0.01) - 0.1 * x.item(), abs=1e-12)


def test_two_muon_steps_match_float64_momentum_and_newton_schulz():
    """A tall 5x3 weight, two steps of Nesterov momentum (B = mu B + (1 - mu) G; update G + mu (B - G)), each
    orthogonalised in float64 and scaled by sqrt(5 / 3); plain momentum uses B itself."""
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(5, 3, generator=g, dtype=torch.float64) for _ in range(2)]
    w0 = torch.randn(5, 3, generator=g, dtype=torch.float64)
    for nesterov in (True, False):
        w = torch.nn.Parameter(w0.clone())
        opt = muon_only(w, nesterov=nesterov, momentum=0.9, weight_decay=0.0)
        expected, buf = w0.clone(), torch.zeros_like(w0)
        for grad in grads:
            w.grad = grad.clone()
            opt.step()
            buf = 0.9 * buf + 0.1 * grad
            update = grad + 0.9 * (buf - grad) if nesterov else buf
            expected = expected - 0.1 * math.sqrt(5 / 3) * newton_schulz_f64(update)
        assert torch.allclose(w.detach(), expected, atol=BF16_TOL * 0.1 * math.sqrt(5 / 3))


def test_muon_takes_the_hidden_matrices_and_adamw_the_embeddings_head_and_vectors():
    model = tiny_llama()
    muon, adamw = split_for_muon(model)
    names = {id(p): n for n, p in model.named_parameters()}
    muon_names = {names[id(p)] for p in muon}
    assert muon_names == {n for n, p in model.named_parameters() if p.ndim == 2 and "layers." in n}
    assert {n for n, _ in adamw} == {n for n in names.values() if n not in muon_names}
    assert any("embed_tokens" in n for n, _ in adamw) and any("lm_head" in n for n, _ in adamw)
    head = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))  # a value head is [1, hidden]
    assert [p.shape for p in split_for_muon(head)[0]] == [torch.Size([8, 8])]


SFT_FLAGS = ("--optim muon --muon.lr 0.03 --muon.momentum 0.9 --muon.ns_steps 3 --muon.no_nesterov "
             "--adam.eps 1e-6 --min_lr_ratio 0.25 --adam.weight_decay 0.05 --lr_warmup_ratio 0")


def _train_args(flags: str, cls: type = SFTConfig) -> StrategyArgs:
    return parse_config(cls, flags.split(), "t").strategy


def _finish(opt: torch.optim.Optimizer, schedule, steps: int) -> list[float]:
    for _ in range(steps):
        opt.step()
        schedule.step()
    return [g["lr"] for g in opt.param_groups]


def test_openrlhf_muon_flags_build_the_muon_and_adamw_groups_and_the_schedule_floor():
    args = _train_args(SFT_FLAGS)
    opt = make_optimizer(args, tiny_llama(), learning_rate=1e-3)
    assert isinstance(opt, MuonWithAdamW) and opt.adamw is not None
    (muon,) = opt.muon.param_groups
    assert (muon["lr"], muon["momentum"], muon["ns_steps"], muon["nesterov"], muon["weight_decay"]) == \
        (0.03, 0.9, 3, False, 0.05)
    decay, no_decay = opt.adamw.param_groups
    assert decay["lr"] == no_decay["lr"] == 1e-3 and decay["eps"] == no_decay["eps"] == 1e-6
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.05, 0.0)
    assert opt.param_groups == [muon, decay, no_decay]
    assert _finish(opt, make_scheduler(args, opt, 10), 10) == pytest.approx([0.03 * 0.25, 1e-3 * 0.25, 1e-3 * 0.25])


def test_adamw_takes_eps_and_the_schedule_floor():
    args = _train_args("--adam.eps 1e-5 --min_lr_ratio 0 --lr_warmup_ratio 0 --adam.betas 0.8 0.9")
    opt = make_optimizer(args, tiny_llama(), learning_rate=1e-3)
    assert isinstance(opt, torch.optim.AdamW)
    assert {(g["eps"], g["betas"]) for g in opt.param_groups} == {(1e-5, (0.8, 0.9))}
    assert _finish(opt, make_scheduler(args, opt, 4), 4) == pytest.approx([0.0, 0.0])


PPO_FLAGS = ("--actor.optim muon --actor.muon.lr 0.01 --actor.muon.momentum 0.8 --actor.muon.ns_steps 4 "
             "--actor.muon.no_nesterov --actor.adam.eps 1e-7 --actor.min_lr_ratio 0.5 --actor.lr_warmup_ratio 0 "
             "--critic.optim adam --critic.adam.betas 0.7 0.8 --critic.adam.eps 1e-4 "
             "--critic.adam.weight_decay 0.02 --critic.lr_scheduler cosine_with_min_lr --critic.lr_warmup_ratio 0.5 "
             "--critic.min_lr_ratio 0.2 --critic.max_norm 0.3 --critic.adam.lr 2e-3 --actor.adam.lr 1e-3")


def test_the_actor_and_critic_get_their_own_optimizer_settings(world_of_one):
    specs = rl_specs(parse_config(PPOConfig, PPO_FLAGS.split(), "t"))
    assert specs.critic is not None
    actor = DeepSpeedStrategy(specs.actor.strategy).prepare_train(tiny_llama(), specs.actor.learning_rate, 4)
    critic = DeepSpeedStrategy(specs.critic.strategy).prepare_train(tiny_llama(), specs.critic.learning_rate, 4)
    assert isinstance(actor, PlainTorchEngine) and isinstance(critic, PlainTorchEngine)
    assert isinstance(actor.optimizer, MuonWithAdamW) and actor.optimizer.adamw is not None
    muon = actor.optimizer.muon.param_groups[0]
    assert (muon["lr"], muon["momentum"], muon["ns_steps"], muon["nesterov"]) == (0.01, 0.8, 4, False)
    assert {g["eps"] for g in actor.optimizer.adamw.param_groups} == {1e-7} and actor.max_norm == 1.0
    assert isinstance(critic.optimizer, torch.optim.AdamW) and critic.max_norm == 0.3
    assert {(g["eps"], g["betas"]) for g in critic.optimizer.param_groups} == {(1e-4, (0.7, 0.8))}
    assert sorted(g["weight_decay"] for g in critic.optimizer.param_groups) == [0.0, 0.02]
    assert [g["lr"] for g in critic.optimizer.param_groups] == [0.0, 0.0]  # warmup: 2 of the 4 steps
    assert _finish(critic.optimizer, critic.lr_scheduler, 2) == pytest.approx([2e-3, 2e-3])
    assert _finish(critic.optimizer, critic.lr_scheduler, 2) == pytest.approx([2e-3 * 0.2] * 2)
    assert _finish(actor.optimizer, actor.lr_scheduler, 4) == pytest.approx([0.005, 5e-4, 5e-4])


def test_the_critic_takes_the_actors_settings_unless_given_its_own():
    cfg = parse_config(PPOConfig, "--adam_betas 0.5 0.6 --max_norm 0.7 --critic.adam.eps 1e-3".split(), "t")
    critic = rl_specs(cfg).critic
    assert critic is not None
    s = critic.strategy
    assert (s.adam_betas, s.max_norm, s.adam_eps, s.optim) == ([0.5, 0.6], 0.7, 1e-3, "adam")


def test_the_critics_muon_flags_reach_its_muon_group(world_of_one):
    flags = ("--critic.optim muon --critic.muon.lr 0.05 --critic.muon.momentum 0.7 --critic.muon.ns_steps 2 "
             "--critic.muon.no_nesterov --critic.adam.lr 3e-3")
    critic = rl_specs(parse_config(PPOConfig, flags.split(), "t")).critic
    assert critic is not None
    opt = make_optimizer(critic.strategy, tiny_llama(), critic.learning_rate)
    assert isinstance(opt, MuonWithAdamW) and opt.adamw is not None
    muon = opt.muon.param_groups[0]
    assert (muon["lr"], muon["momentum"], muon["ns_steps"], muon["nesterov"]) == (0.05, 0.7, 2, False)
    assert {g["lr"] for g in opt.adamw.param_groups} == {3e-3}


@pytest.mark.parametrize("flags, named", [
    ("--critic.adam.eps 0", "--critic_adam_eps 0"),
    ("--critic.min_lr_ratio 2", "--critic_min_lr_ratio 2"),
    ("--critic.lr_scheduler constant --critic.min_lr_ratio 0.5", "--critic_min_lr_ratio only applies"),
    ("--actor.muon.momentum 1", "--muon_momentum 1"),
    ("--actor.muon.ns_steps 0", "--muon_ns_steps 0"),
])
def test_bad_optimizer_flags_fail_with_the_flag_named(flags, named):
    with pytest.raises(UserError, match=named):
        parse_config(PPOConfig, flags.split(), "t")


def test_muon_state_resumes_through_the_engine_checkpoint(world_of_one, tmp_path):
    args = _train_args(SFT_FLAGS + " --train_batch_size 2 --micro_train_batch_size 2")
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))

    def engine() -> PlainTorchEngine:
        return DeepSpeedStrategy(args).prepare_train(tiny_llama(), 1e-3, 5)

    def step(e: PlainTorchEngine) -> None:
        e.backward(e(input_ids=ids, labels=ids).loss)
        e.step()

    first = engine()
    step(first)
    first.save_checkpoint(str(tmp_path), "t")
    step(first)
    second = engine()
    second.load_checkpoint(str(tmp_path), "t")
    step(second)
    assert second.get_lr() == first.get_lr()
    inner = second.optimizer
    assert isinstance(inner, MuonWithAdamW) and inner.adamw is not None
    assert len(inner.state) == len(inner.muon.state) + len(inner.adamw.state) == len(list(first.module.parameters()))
    for a, b in zip(first.module.parameters(), second.module.parameters()):
        assert torch.equal(a, b)


def test_muon_under_deepspeed_zero0_is_the_plain_engine_and_other_stages_fail(world_of_one, tmp_path):
    """DeepSpeed ZeRO-0 in fp32 steps the client optimizer on whole weights (as over several ranks, after
    averaging the gradients): one rank of it trains exactly as the plain engine, and its checkpoint resumes there."""
    from tests.distributed.test_plain_torch_engine import ACCUM, STEPS, batches, strategy, train, weights

    data = batches(STEPS * ACCUM)
    local = strategy(True, optim="muon").prepare_train(tiny_llama(), 1e-2, STEPS)
    ds = strategy(False, optim="muon").prepare_train(tiny_llama(), 1e-2, STEPS)
    assert not isinstance(ds, PlainTorchEngine) and isinstance(ds.optimizer, MuonWithAdamW)
    assert train(local, data) == pytest.approx(train(ds, data), rel=1e-6)
    # Muon orthogonalises each update in bfloat16: where the two engines' gradients differ in their last fp32 bits
    # (DeepSpeed sums and clips them in its own order), an update entry can round to the next bfloat16 value, 2^-8
    # of its size. Measured on an AMD Zen 3 without AVX-512 (bf16 emulated): 5e-5 after 3 steps at lr 1e-2; bit-equal
    # on a Zen 5. The bound: one bfloat16 step of a unit-sized update per optimizer step.
    muon_bound = STEPS * 1e-2 * 2.0**-7
    for name, w in weights(ds).items():
        torch.testing.assert_close(weights(local)[name], w, rtol=1e-5, atol=muon_bound)
    ds.save_checkpoint(str(tmp_path), tag="ds")
    assert strategy(True, optim="muon").prepare_train(tiny_llama(1), 1e-2, STEPS).load_checkpoint(
        str(tmp_path), tag="ds")[0] is not None

    needs = "--optim muon over several processes needs --zero_stage 0"
    with pytest.raises(UserError, match=needs):
        strategy(False, optim="muon", zero_stage=1).prepare_train(tiny_llama(), 1e-3, 2)
    for settings, bf16 in (({"zero_stage": 3}, False), ({"zero_stage": 0}, True), ({"adam_offload": True}, False)):
        args = dataclasses.replace(_train_args("--optim muon --zero_stage 0"), **settings)
        with pytest.raises(UserError, match=needs):
            optimizers.check_deepspeed_optimizer(args, bf16)
    optimizers.check_deepspeed_optimizer(_train_args("--optim adam"), bf16=True)  # AdamW runs everywhere
