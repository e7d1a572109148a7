"""The single-process PlainTorchEngine against DeepSpeed ZeRO-0 over one rank: same losses, same weights, checkpoints
that resume exactly (its own and DeepSpeed's), and the strategy choosing it only where DeepSpeed adds nothing."""

from __future__ import annotations

import pytest
import torch

from rlhfkit.config.common import StrategyArgs
from rlhfkit.distributed.plain_torch_engine import PlainTorchEngine
from rlhfkit.distributed.strategy import DeepSpeedStrategy

STEPS, MICRO, ACCUM = 3, 2, 2


def tiny_llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(config).float()


def strategy(local: bool, **kw) -> DeepSpeedStrategy:
    settings = dict(zero_stage=0, train_batch_size=MICRO * ACCUM, micro_train_batch_size=MICRO,
                    learning_rate=1e-2, lr_warmup_ratio=0.0, lr_scheduler="cosine_with_min_lr", max_norm=0.05, l2=0.1)
    args = StrategyArgs(**{**settings, **kw})
    s = DeepSpeedStrategy(args)
    s.setup_distributed()
    if not local:
        s.uses_plain_torch_engine = lambda: False  # force the DeepSpeed engine for the comparison
    return s


def batches(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 64, (MICRO, 12), generator=g) for _ in range(n)]


def train(engine, data: list[torch.Tensor]) -> list[float]:
    losses = []
    for ids in data:
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def weights(engine) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in DeepSpeedStrategy.unwrap(engine).state_dict().items()}


def test_plain_torch_engine_matches_deepspeed_zero0_and_reads_its_checkpoint(world_of_one, tmp_path):
    data = batches(STEPS * ACCUM)
    local_s, ds_s = strategy(True), strategy(False)
    local = local_s.prepare_train(tiny_llama(), 1e-2, STEPS)
    ds = ds_s.prepare_train(tiny_llama(), 1e-2, STEPS)
    assert isinstance(local, PlainTorchEngine) and not isinstance(ds, PlainTorchEngine)
    assert local.optimizer.param_groups[0]["fused"] is True  # the fused AdamW kernel on CPU
    local_losses, ds_losses = train(local, data), train(ds, data)
    assert local_losses == pytest.approx(ds_losses, rel=1e-5, abs=1e-6)
    assert local.get_lr() == pytest.approx(ds.get_lr(), rel=1e-7)
    assert local.get_global_grad_norm() > 0.05  # clipping was active, so the formula mattered
    for name, w in weights(ds).items():
        torch.testing.assert_close(weights(local)[name], w, rtol=1e-5, atol=1e-6)

    # a DeepSpeed ZeRO-0 checkpoint resumes on the PlainTorchEngine and continues like DeepSpeed itself
    ds.save_checkpoint(str(tmp_path), tag="ds")
    resumed = strategy(True).prepare_train(tiny_llama(seed=5), 1e-2, STEPS * 2)
    resumed.lr_scheduler = None  # compared below on weights only; the schedule spans different runs
    path, _ = resumed.load_checkpoint(str(tmp_path), tag="ds")
    assert path is not None and resumed.global_steps == STEPS
    for name, w in weights(ds).items():
        assert torch.equal(weights(resumed)[name], w)


def test_local_checkpoint_resumes_exactly(world_of_one, tmp_path):
    data = batches(4 * ACCUM)
    straight = strategy(True).prepare_train(tiny_llama(), 1e-2, 4)
    reference = train(straight, data)

    first = strategy(True).prepare_train(tiny_llama(), 1e-2, 4)
    assert train(first, data[:2 * ACCUM]) == reference[:2 * ACCUM]
    first.save_checkpoint(str(tmp_path), tag="global_step2")
    second = strategy(True).prepare_train(tiny_llama(seed=9), 1e-2, 4)
    path, _ = second.load_checkpoint(str(tmp_path), tag="global_step2")
    assert path == str(tmp_path / "global_step2")
    assert train(second, data[2 * ACCUM:]) == reference[2 * ACCUM:]
    assert second.get_lr() == straight.get_lr()
    for name, w in weights(straight).items():
        assert torch.equal(weights(second)[name], w)
    assert second.load_checkpoint(str(tmp_path), tag="missing") == (None, {})


def test_deepspeed_is_kept_where_it_does_something(world_of_one):
    assert strategy(True).uses_plain_torch_engine()
    assert strategy(True, zero_stage=2).uses_plain_torch_engine()  # ZeRO-2 over one rank partitions nothing
    assert not strategy(True, zero_stage=3).uses_plain_torch_engine()
    assert not strategy(True, adam_offload=True).uses_plain_torch_engine()
    bf16 = DeepSpeedStrategy(StrategyArgs(train_batch_size=4, micro_train_batch_size=2), bf16=True)
    assert not bf16.uses_plain_torch_engine()
