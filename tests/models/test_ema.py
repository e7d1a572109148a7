"""The actor's EMA against its closed form: ema_k = beta^k w_0 + (1 - beta) sum_j beta^(k-j) w_j."""

from __future__ import annotations

import functools
import os

import pytest
import torch
from torch import nn

from rlhfkit.models.ema import ParameterEMA


def test_ema_equals_closed_form_after_k_steps():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    model[1].bias.requires_grad_(False)  # a frozen parameter is not averaged
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    beta, k = 0.9, 5
    ema = ParameterEMA(model, beta)
    iterates = [{n: p.detach().double().clone() for n, p in model.named_parameters()}]
    for _ in range(k):
        opt.zero_grad()
        model(torch.randn(8, 4)).pow(2).mean().backward()
        opt.step()
        ema.update(model)
        iterates.append({n: p.detach().double().clone() for n, p in model.named_parameters()})
    assert set(ema.shadow) == {"0.weight", "0.bias", "1.weight"}
    for name, value in ema.shadow.items():
        closed = beta ** k * iterates[0][name] + sum((1 - beta) * beta ** (k - j) * iterates[j][name]
                                                     for j in range(1, k + 1))
        torch.testing.assert_close(value.double(), closed, atol=1e-6, rtol=0)

    current = {n: p.detach().clone() for n, p in model.named_parameters()}
    with ema.swapped_in(model):
        torch.testing.assert_close(model[0].weight.detach(), ema.shadow["0.weight"])
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), current[n])  # the training weights come back

    restored = ParameterEMA(model, beta)
    restored.load_state_dict(ema.state_dict())
    assert restored.updates == k and torch.equal(restored.shadow["0.bias"], ema.shadow["0.bias"])
    with pytest.raises(ValueError, match="beta"):
        ParameterEMA(model, 1.0)


@pytest.mark.parametrize("backend", ["zero3", "fsdp2"])
def test_sharded_training_keeps_the_average_sharded_and_exports_it(world_of_one, backend):
    """Under DeepSpeed ZeRO-3 the average is kept per partition (`ds_tensor`), under FSDP2 per local shard of each
    DTensor parameter (at world 1 the shard is the whole tensor: this checks the DTensor path; the split is
    checked at world 2 below); the gathered export inside `swapped_in` equals the float64 closed form of the
    gathered iterates, and the training weights come back."""
    check_sharded_ema(backend)


@pytest.mark.parametrize("backend", ["zero3", "fsdp2"])
def test_the_average_is_split_over_two_ranks_and_still_exports_the_closed_form(backend):
    """The same at world 2 (2 spawned gloo ranks): each rank's average holds about half of the model."""
    from tests.helpers import spawn_ranks

    spawn_ranks(functools.partial(_ema_rank, backend=backend), 2)


def _ema_rank(rank: int, world: int, port: int, backend: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    check_sharded_ema(backend)


def check_sharded_ema(backend: str) -> None:
    """Train 4 steps with an EMA on `backend` in the current world and check it against the float64 closed form."""
    from torch.distributed.tensor import DTensor

    from rlhfkit.config.common import StrategyArgs
    from rlhfkit.distributed.strategy import DeepSpeedStrategy
    from tests.distributed.test_strategy_checkpointing import tiny_llama

    layout = {"zero_stage": 3} if backend == "zero3" else {"backend": "fsdp2"}
    world = int(os.environ["WORLD_SIZE"])
    strategy = DeepSpeedStrategy(StrategyArgs(train_batch_size=2 * world, micro_train_batch_size=2, **layout))
    strategy.setup_distributed()
    engine = strategy.prepare_train(tiny_llama(), 1e-2, 10)
    module = strategy.unwrap(engine)
    beta, k = 0.8, 4
    ema = ParameterEMA(module, beta)
    total = sum(p.numel() for p in tiny_llama().parameters())
    held = sum(v.numel() for v in ema.shadow.values())
    assert held <= total // world + 4096, (held, total, world)  # about 1/world of the model (padding, odd rows)
    if backend == "zero3":
        assert all(v.dim() == 1 for v in ema.shadow.values())  # partitions, not full tensors
    else:
        assert all(isinstance(p, DTensor) for p in module.parameters())
        assert all(not isinstance(v, DTensor) for v in ema.shadow.values())  # plain CPU copies of the shards

    def gathered() -> dict[str, torch.Tensor]:  # every rank gathers; rank 0 receives the full tensors
        full = strategy.full_state_dict(engine)
        return {n: v.double().clone() for n, v in (full or {}).items()}

    iterates = [gathered()]
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    for _ in range(k):
        engine.train()
        engine.backward(engine(input_ids=ids, labels=ids, use_cache=False).loss)
        engine.step()
        ema.update(module)
        iterates.append(gathered())
    with ema.swapped_in(module):
        exported = gathered()
    if strategy.rank != 0:
        gathered()  # the last gather below, a collective
        return
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.norm.weight", "model.embed_tokens.weight"):
        closed = beta ** k * iterates[0][name] + sum((1 - beta) * beta ** (k - j) * iterates[j][name]
                                                     for j in range(1, k + 1))
        torch.testing.assert_close(exported[name], closed, atol=1e-6, rtol=0, msg=name)
        assert not torch.equal(exported[name], iterates[-1][name])  # the average, not the last weights
    after = gathered()
    assert all(torch.equal(after[n], iterates[-1][n]) for n in after)  # the training weights come back
