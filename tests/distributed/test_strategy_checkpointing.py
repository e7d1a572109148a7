"""--gradient_checkpointing_use_reentrant reaches the model's activation checkpointing, and both variants give the
same gradients (they recompute the same forward; only the autograd mechanics differ)."""

from __future__ import annotations

import torch

from rlhfkit.config.common import StrategyArgs
from rlhfkit.distributed.strategy import DeepSpeedStrategy


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def gradients(use_reentrant: bool) -> tuple[dict[str, torch.Tensor], str]:
    """Grads of one LM loss through an engine from `prepare_train`, and the autograd node that produced the last
    checkpointed layer's output (what the final norm receives)."""
    strategy = DeepSpeedStrategy(StrategyArgs(zero_stage=0, train_batch_size=2, micro_train_batch_size=2),
                                 gradient_checkpointing=True, gradient_checkpointing_use_reentrant=use_reentrant)
    strategy.setup_distributed()
    engine = strategy.prepare_train(tiny_llama(), 1e-3, 10)
    module = strategy.unwrap(engine)
    seen: list[str] = []
    handle = module.model.norm.register_forward_pre_hook(lambda m, args: seen.append(type(args[0].grad_fn).__name__))
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    engine.train()
    out = engine(input_ids=ids, labels=ids, use_cache=False)
    engine.backward(out.loss)
    handle.remove()
    grads = {n: p.grad.detach().clone() for n, p in module.named_parameters() if p.grad is not None}
    return grads, seen[0]


def test_reentrant_flag_selects_the_checkpoint_variant_and_gradients_match(world_of_one):
    reentrant, reentrant_node = gradients(True)
    plain, plain_node = gradients(False)
    # torch.utils.checkpoint's reentrant variant is an autograd Function (CheckpointFunction); the non-reentrant
    # one records the layer's own ops under saved-tensor hooks.
    assert reentrant_node == "CheckpointFunctionBackward"
    assert plain_node != "CheckpointFunctionBackward"
    assert set(reentrant) == set(plain) and len(plain) > 10
    for name in plain:
        torch.testing.assert_close(reentrant[name], plain[name], rtol=1e-5, atol=1e-7, msg=name)
    assert max(g.abs().max() for g in plain.values()) > 0
