"""Non-finite guard: an update whose loss and gradients are NaN is skipped (weights unchanged) and counted, the run
continues, and `limit` skipped steps in a row stop it; where DeepSpeed cannot skip (ZeRO 0 in fp32) it stops at
once. The NaN comes from a real model whose weight is poisoned (inf) for one forward/backward, then restored."""

from __future__ import annotations

import pytest
import torch

from rlhfkit.config.common import StrategyArgs
from rlhfkit.distributed.nonfinite import NonFiniteGuard, NonFiniteStop
from rlhfkit.distributed.strategy import DeepSpeedStrategy


def tiny_engine(zero_stage: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    strategy = DeepSpeedStrategy(StrategyArgs(zero_stage=zero_stage, train_batch_size=2, micro_train_batch_size=2,
                                              lr_scheduler="constant", lr_warmup_ratio=0.0))
    strategy.setup_distributed()
    engine = strategy.prepare_train(LlamaForCausalLM(config), 1e-2, 10)
    engine.train()
    return engine, strategy.unwrap(engine)


def weights(module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def one_step(engine, module, poison: bool) -> None:
    """One optimizer step on a fixed batch; with `poison` the final norm's weight is inf during forward and
    backward (so the loss and every gradient are NaN/inf) and restored before the optimizer step."""
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    weight = module.model.norm.weight
    saved = weight.detach().clone()
    if poison:
        with torch.no_grad():
            weight.fill_(float("inf"))
    loss = engine(input_ids=ids, labels=ids, use_cache=False).loss
    assert torch.isfinite(loss).item() is not poison
    engine.backward(loss)
    with torch.no_grad():
        weight.copy_(saved)
    engine.step()


def unchanged(before: dict[str, torch.Tensor], module) -> bool:
    return all(torch.equal(before[n], p.detach()) for n, p in module.named_parameters())


@pytest.mark.parametrize("zero_stage", [0, 2])  # both run on rlhfkit's PlainTorchEngine at world size 1
def test_nonfinite_update_is_skipped_counted_and_too_many_in_a_row_stop(world_of_one, zero_stage):
    engine, module = tiny_engine(zero_stage=zero_stage)
    guard = NonFiniteGuard(limit=2, what="sft")
    guard.watch(engine)
    start = weights(module)
    one_step(engine, module, poison=False)
    assert guard.after_step(1, engine) == 0 and not unchanged(start, module)

    before = weights(module)
    one_step(engine, module, poison=True)
    assert guard.after_step(2, engine) == 1 and guard.in_a_row == 1
    assert unchanged(before, module)  # skipped: not a single weight moved

    one_step(engine, module, poison=False)  # the run continues and trains again
    assert guard.after_step(3, engine) == 1 and guard.in_a_row == 0
    assert not unchanged(before, module) and all(torch.isfinite(p).all() for p in module.parameters())

    before = weights(module)
    one_step(engine, module, poison=True)
    assert guard.after_step(4, engine) == 2
    one_step(engine, module, poison=True)
    with pytest.raises(NonFiniteStop, match=r"sft stopped at step 5: 2 optimizer steps in a row .* non-finite"):
        guard.after_step(5, engine)
    assert unchanged(before, module)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_weights_finite_finds_one_bad_entry_among_mixed_dtypes(bad):
    """The fused check (one norm per tensor, one sync per dtype) against the per-entry definition."""
    from rlhfkit.distributed.nonfinite import weights_finite

    params = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(7).to(torch.bfloat16)),
              torch.nn.Parameter(torch.randn(2, 2, 2, dtype=torch.float64))]
    assert weights_finite(params)
    for p in params:
        with torch.no_grad():
            saved = p.view(-1)[1].clone()
            p.view(-1)[1] = bad
        assert not weights_finite(params), p.dtype
        with torch.no_grad():
            p.view(-1)[1] = saved
    frozen = torch.nn.Parameter(torch.full((3,), bad), requires_grad=False)  # not trained: not checked
    assert weights_finite(params + [frozen])
    assert weights_finite([])
