"""The FSDP2 engine in a world of one against the plain-torch engine (DeepSpeed ZeRO-0's arithmetic): same losses,
weights and clipped gradient norm, a DCP checkpoint that resumes exactly, the export's keys, and which modules
become FSDP units. The world-2 parity runs are in test_fsdp2_parity.py."""

from __future__ import annotations

import pytest
import torch

from rlhfkit.config.common import StrategyArgs
from rlhfkit.distributed.fsdp2_engine import FSDP2Engine, tied_duplicates, units_to_shard
from rlhfkit.distributed.plain_torch_engine import PlainTorchEngine
from rlhfkit.distributed.strategy import DeepSpeedStrategy
from tests.distributed.test_plain_torch_engine import ACCUM, MICRO, batches, tiny_llama, train, weights


def strategy(backend: str) -> DeepSpeedStrategy:
    s = DeepSpeedStrategy(StrategyArgs(backend=backend, zero_stage=0, train_batch_size=MICRO * ACCUM,
                                       micro_train_batch_size=MICRO, lr_warmup_ratio=0.0, max_norm=0.05, l2=0.1))
    s.setup_distributed()
    return s


def full_weights(engine: FSDP2Engine) -> dict[str, torch.Tensor]:
    state = engine.full_state_dict()
    assert state is not None  # rank 0
    return state


def test_fsdp2_matches_the_plain_engine_and_resumes_from_its_checkpoint(world_of_one, tmp_path):
    data = batches(4 * ACCUM)
    plain = strategy("deepspeed").prepare_train(tiny_llama(), 1e-2, 4)
    sharded = strategy("fsdp2").prepare_train(tiny_llama(), 1e-2, 4)
    assert isinstance(plain, PlainTorchEngine) and isinstance(sharded, FSDP2Engine)
    assert train(sharded, data[:2 * ACCUM]) == pytest.approx(train(plain, data[:2 * ACCUM]), rel=1e-5, abs=1e-6)
    assert sharded.get_global_grad_norm() == pytest.approx(plain.get_global_grad_norm(), rel=1e-5)
    assert plain.get_global_grad_norm() > 0.05  # clipping was active, so the DTensor norm mattered
    gathered = full_weights(sharded)
    assert gathered.keys() == weights(plain).keys()  # untied: the export keeps every tensor
    for name, w in weights(plain).items():
        torch.testing.assert_close(gathered[name], w, rtol=1e-5, atol=1e-6)

    sharded.save_checkpoint(str(tmp_path), tag="global_step2")
    resumed = strategy("fsdp2").prepare_train(tiny_llama(seed=9), 1e-2, 4)
    assert resumed.load_checkpoint(str(tmp_path), tag="missing") == (None, {})
    path, _ = resumed.load_checkpoint(str(tmp_path), tag="global_step2")
    assert path == str(tmp_path / "global_step2") and resumed.global_steps == 2
    rest = train(plain, data[2 * ACCUM:])
    assert train(resumed, data[2 * ACCUM:]) == pytest.approx(rest, rel=1e-5, abs=1e-6)
    assert resumed.get_lr() == pytest.approx(plain.get_lr(), rel=1e-7)
    gathered = full_weights(resumed)
    for name, w in weights(plain).items():
        torch.testing.assert_close(gathered[name], w, rtol=1e-5, atol=1e-6)


def test_units_are_the_layers_and_apart_called_backbone_and_head():
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, num_labels=1)
    rm = LlamaForSequenceClassification(config)
    assert units_to_shard(rm) == [*rm.model.layers, rm.score, rm.model]
    untied = LlamaForCausalLM(config)
    assert units_to_shard(untied) == [*untied.model.layers, untied.lm_head, untied.model]
    config.tie_word_embeddings = True
    tied = LlamaForCausalLM(config)
    assert units_to_shard(tied) == list(tied.model.layers)  # the root owns the shared embedding and head
    assert tied_duplicates(tied) == {"lm_head.weight"} and tied_duplicates(untied) == set()


def test_lora_trains_like_the_plain_engine_and_exports_merged(world_of_one):
    from peft import LoraConfig, get_peft_model

    from rlhfkit.models.lora import merged_for_saving

    def lora_llama():
        config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
        return get_peft_model(tiny_llama(), config)

    data = batches(2 * ACCUM)
    plain = strategy("deepspeed").prepare_train(lora_llama(), 1e-2, 2)
    sharded = strategy("fsdp2").prepare_train(lora_llama(), 1e-2, 2)
    assert train(sharded, data) == pytest.approx(train(plain, data), rel=1e-5, abs=1e-6)
    exported = sharded.export_module(full_weights(sharded))
    assert not isinstance(exported, type(sharded.module))  # an unsharded copy, merged on rank 0 alone
    merged, reference = merged_for_saving(exported).state_dict(), merged_for_saving(plain.module).state_dict()
    assert merged.keys() == reference.keys()
    for name, w in reference.items():
        torch.testing.assert_close(merged[name], w, rtol=1e-5, atol=1e-6)


def test_frozen_roles_shard_and_the_weight_stream_gathers_one_full_tensor_at_a_time(world_of_one):
    """The RL roles on FSDP2: a reference/reward model sharded by `prepare_eval` computes the plain model's logits;
    the actor's weights stream to the engines as full tensors (`full_tensor()` per parameter) under the names and
    shapes `weight_metas` announced, equal to the unsharded weights."""
    from types import SimpleNamespace

    from torch.distributed.tensor import DTensor

    from rlhfkit.distributed.weight_sync import iter_full_parameters, weight_metas

    plain, ids = tiny_llama(), torch.randint(0, 64, (2, 7))
    frozen = strategy("fsdp2").prepare_eval(tiny_llama(), shard_fsdp2=True)
    assert all(isinstance(p, DTensor) and not p.requires_grad for p in frozen.parameters())
    with torch.no_grad():
        torch.testing.assert_close(frozen(input_ids=ids).logits, plain(input_ids=ids).logits, rtol=1e-5, atol=1e-6)
    actor = SimpleNamespace(engine=strategy("fsdp2").prepare_train(tiny_llama(), 1e-2, 4))
    streamed = dict(iter_full_parameters(actor.engine))
    expected = dict(plain.named_parameters())
    assert [(n, tuple(t.shape)) for n, t in streamed.items() if t is not None] == \
        [(n, shape) for n, _, shape in weight_metas(actor) or []]
    assert streamed.keys() == expected.keys()
    for name, tensor in streamed.items():
        assert tensor is not None and not isinstance(tensor, DTensor)
        torch.testing.assert_close(tensor, expected[name].detach(), rtol=0, atol=0)
