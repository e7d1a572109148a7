"""Shared-prefix forward: same logits, loss and gradients as the plain right-padded forward, in float64.

Transformers' RMSNorm computes in float32 whatever the model's dtype, which leaves float32 rounding (~1e-8 relative)
in float64 gradients that any change of batch shape moves; the test models use a float64 RMSNorm instead, so the
comparison can be to 1e-10.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from rlhfkit.demo.assets import tiny_llama_config
from rlhfkit.models.shared_prefix import group_prefixes, saved_fraction, shared_prefix_logits, supports_shared_prefix

VOCAB = 61


def float64_norms(model: torch.nn.Module) -> torch.nn.Module:
    """`model` in float64 with every RMSNorm computed in float64: weight * x / sqrt(mean(x^2) + eps)."""
    model = model.double()
    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm"):
            def forward(x, norm=module):
                return norm.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
            module.forward = forward
    return model


def llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = tiny_llama_config(VOCAB, 1, 2, 0, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2)
    return float64_norms(LlamaForCausalLM(config))


def qwen2() -> Qwen2ForCausalLM:
    torch.manual_seed(1)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    return float64_norms(Qwen2ForCausalLM(config))


def batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded rows: three of prompt A (length 5), two of prompt B (length 3), one of prompt C (length 4),
    with continuations of different lengths."""
    g = torch.Generator().manual_seed(3)
    prompts = {"A": torch.randint(3, VOCAB, (5,), generator=g), "B": torch.randint(3, VOCAB, (3,), generator=g),
               "C": torch.randint(3, VOCAB, (4,), generator=g)}
    spec = [("A", 4), ("B", 6), ("A", 2), ("C", 5), ("A", 6), ("B", 1)]
    width = max(len(prompts[p]) + n for p, n in spec)
    ids = torch.zeros(len(spec), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (p, n) in enumerate(spec):
        row = torch.cat([prompts[p], torch.randint(3, VOCAB, (n,), generator=g)])
        ids[i, :len(row)], mask[i, :len(row)] = row, 1
    lengths = torch.tensor([len(prompts[p]) for p, _ in spec])
    return ids, mask, lengths


def plain_logits(model, ids, mask, lengths, width):
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    positions = (lengths[:, None] - 1 + torch.arange(width)[None, :]).clamp(max=ids.shape[1] - 1)
    return logits.gather(1, positions[..., None].expand(-1, -1, logits.shape[-1]))


def target_mask(ids, mask, lengths, width):
    columns = lengths[:, None] + torch.arange(width)[None, :]
    inside = columns < ids.shape[1]
    return mask.gather(1, columns.clamp(max=ids.shape[1] - 1)) * inside


def loss_of(logits, ids, mask, lengths):
    width = logits.shape[1]
    columns = (lengths[:, None] + torch.arange(width)[None, :]).clamp(max=ids.shape[1] - 1)
    logp = torch.log_softmax(logits, dim=-1).gather(2, ids.gather(1, columns)[..., None])[..., 0]
    weights = torch.linspace(0.5, 1.5, logp.numel(), dtype=logp.dtype).view_as(logp)  # not a symmetric sum
    return -(logp * weights * target_mask(ids, mask, lengths, width)).sum()


def test_groups_are_the_distinct_prefixes_left_padded():
    ids, mask, lengths = batch()
    groups = group_prefixes(ids, lengths)
    assert groups.owner.tolist() == [0, 1, 0, 2, 0, 1]
    assert groups.lengths.tolist() == [5, 3, 4]
    assert groups.mask.tolist() == [[1] * 5, [0, 0, 1, 1, 1], [0, 1, 1, 1, 1]]
    assert groups.ids[1, 2:].tolist() == ids[1, :3].tolist()
    # rows 0, 2, 4 repeat prefix A (5 tokens) twice, rows 1, 5 prefix B once: 13 of the real tokens not run
    assert saved_fraction(groups, mask) == pytest.approx(13 / float(mask.sum()))


@pytest.mark.parametrize("make", [llama, qwen2], ids=["llama", "qwen2"])
@pytest.mark.parametrize("width", [1, 3, 7])
def test_logits_loss_and_gradients_equal_the_plain_forward(make, width):
    ids, mask, lengths = batch()
    model = make()
    plain = plain_logits(model, ids, mask, lengths, width)
    plain_loss = loss_of(plain, ids, mask, lengths)
    plain_loss.backward()
    plain_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    shared = shared_prefix_logits(model, ids, mask, lengths, width)
    loss = loss_of(shared, ids, mask, lengths)
    loss.backward()
    keep = target_mask(ids, mask, lengths, width).bool()
    keep[:, 0] = True  # the first entry is always the prefix's last logits
    torch.testing.assert_close(shared[keep], plain[keep], rtol=0, atol=1e-10)
    torch.testing.assert_close(loss, plain_loss, rtol=0, atol=1e-10)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, plain_grads[name], rtol=0, atol=1e-10, msg=name)


def test_gradient_checkpointing_and_flash_attention_are_not_supported():
    model = llama()
    assert supports_shared_prefix(model)
    model.gradient_checkpointing_enable()
    assert not supports_shared_prefix(model)
    other = llama()
    other.config._attn_implementation = "flash_attention_2"
    assert not supports_shared_prefix(other)
