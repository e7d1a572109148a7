"""`trimmed_forward` (the last decoder layer only where logits are read) gives the plain Hugging Face forward's
logits, loss and every parameter gradient (float64, random-init tiny Llama / Qwen2 / Qwen3, within 1e-10): padded
rows either side, kept positions as a suffix or scattered, a packed 4D mask, a KV cache (which receives every
position's keys and values), a LoRA model, and the fallback for a model it does not trim."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)
from transformers.cache_utils import DynamicCache

from rlhfkit.demo.assets import tiny_llama_config
from rlhfkit.models.policy import packed_attention_mask
from rlhfkit.models.trimmed_forward import trimmed_forward

VOCAB, T = 64, 14
SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, max_position_embeddings=128)


def build(kind: str = "llama", impl: str = "sdpa") -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "llama":
        config = tiny_llama_config(VOCAB, 1, 2, 0, num_hidden_layers=3, attn_implementation=impl)
        model = LlamaForCausalLM(config)
    else:
        classes = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM),
                   "mistral": (MistralConfig, MistralForCausalLM)}  # Mistral: a 4096-token window, not in effect
        config_type, model_type = classes[kind]
        model = model_type(config_type(vocab_size=VOCAB, attn_implementation=impl, **SMALL))
    return model.double().train()


def batch(padding: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    ids = torch.randint(3, VOCAB, (3, T))
    mask = torch.ones_like(ids)
    if padding == "right":
        mask[1, 10:] = 0
        mask[2, 12:] = 0
    elif padding == "left":
        mask[1, :3] = 0
        mask[2, :1] = 0
    return {"input_ids": ids, "attention_mask": mask}


def loss_of(logits: torch.Tensor) -> torch.Tensor:
    """A loss that reads every kept logit: weighted log-probs of fixed labels."""
    gen = torch.Generator().manual_seed(2)
    labels = torch.randint(0, VOCAB, logits.shape[:2], generator=gen)
    weights = torch.rand(logits.shape[:2], generator=gen, dtype=torch.float64)
    logp = torch.log_softmax(logits, dim=-1).gather(-1, labels[..., None])[..., 0]
    return (logp * weights).sum()


def run(model: torch.nn.Module, fn) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    logits = fn()
    loss = loss_of(logits)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), loss.detach(), grads


def query_rows(model: torch.nn.Module) -> tuple[list[int], object]:
    """Positions the last layer's q_proj sees in each forward (to tell the trimmed path from the fallback)."""
    seen: list[int] = []
    q_proj = model.model.layers[-1].self_attn.q_proj
    return seen, q_proj.register_forward_hook(lambda mod, args, out: seen.append(args[0].shape[1]))


def assert_same(model: torch.nn.Module, inputs: dict, keep: torch.Tensor, trims: bool = True) -> None:
    plain = run(model, lambda: model(**inputs).logits[:, keep])
    seen, hook = query_rows(model)
    try:
        trimmed = run(model, lambda: trimmed_forward(model, keep, **inputs))
    finally:
        hook.remove()
    assert set(seen) == {len(keep) if trims else inputs["input_ids"].shape[1]}  # (checkpointing: twice)
    assert trimmed[0].shape == plain[0].shape
    torch.testing.assert_close(trimmed[0], plain[0], atol=1e-10, rtol=0)
    torch.testing.assert_close(trimmed[1], plain[1], atol=1e-10, rtol=0)
    assert trimmed[2].keys() == plain[2].keys() and len(plain[2]) == len(list(model.parameters()))
    for name, grad in plain[2].items():
        torch.testing.assert_close(trimmed[2][name], grad, atol=1e-10, rtol=0, msg=name)
    last = model.model.layers[-1]
    assert "forward" not in last.__dict__ and "forward" not in last.self_attn.__dict__  # their own forwards are back


SUFFIX, SCATTERED = torch.arange(9, T), torch.tensor([0, 3, 4, 8, 12, 13])


@pytest.mark.parametrize("kind,impl", [("llama", "sdpa"), ("llama", "eager"), ("qwen2", "sdpa"), ("qwen3", "eager"),
                                       ("mistral", "sdpa")])
@pytest.mark.parametrize("keep", [SUFFIX, SCATTERED, torch.arange(T)], ids=["suffix", "scattered", "all"])
def test_right_padded_rows(kind, impl, keep):
    assert_same(build(kind, impl), batch("right"), keep)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("keep", [SUFFIX, SCATTERED], ids=["suffix", "scattered"])
def test_left_padded_rows(kind, keep):
    # sdpa only: HF's eager attention softmaxes in float32, where float64's mask minimum is -inf, so fully masked
    # (left-padding) query rows are NaN there with or without trimming
    assert_same(build(kind, "sdpa"), batch("left"), keep)


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("keep", [SUFFIX, SCATTERED], ids=["suffix", "scattered"])  # a slice, an index tensor
def test_unpadded_rows_without_a_mask(impl, keep):
    assert_same(build("llama", impl), {"input_ids": batch("none")["input_ids"]}, keep)


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_packed_rows_with_a_4d_mask(impl):
    model = build("llama", impl)
    sample_ids = torch.tensor([[0] * 5 + [1] * 6 + [2] * 2 + [-1]])
    positions = torch.tensor([list(range(5)) + list(range(6)) + list(range(2)) + [0]])
    inputs = {"input_ids": batch("none")["input_ids"][:1], "position_ids": positions,
              "attention_mask": packed_attention_mask(sample_ids, torch.float64)}
    assert_same(model, inputs, torch.tensor([1, 4, 5, 9, 10, 12]))


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_a_cache_gets_every_position_and_a_later_forward_reads_it_unchanged(kind):
    model = build(kind).eval()
    ids = batch("none")["input_ids"]
    config = model.config
    with torch.no_grad():
        plain_cache, trimmed_cache = DynamicCache(config=config), DynamicCache(config=config)
        plain = model(input_ids=ids[:, :9], past_key_values=plain_cache, use_cache=True).logits[:, -1:]
        trimmed = trimmed_forward(model, torch.tensor([8]), input_ids=ids[:, :9], past_key_values=trimmed_cache,
                                  use_cache=True)
        torch.testing.assert_close(trimmed, plain, atol=1e-10, rtol=0)
        for a, b in zip(plain_cache.layers, trimmed_cache.layers, strict=True):
            assert b.keys.shape[2] == 9
            torch.testing.assert_close(b.keys, a.keys, atol=1e-10, rtol=0)
            torch.testing.assert_close(b.values, a.values, atol=1e-10, rtol=0)
        after_plain = model(input_ids=ids[:, 9:], past_key_values=plain_cache, use_cache=True).logits
        after_trimmed = model(input_ids=ids[:, 9:], past_key_values=trimmed_cache, use_cache=True).logits
        torch.testing.assert_close(after_trimmed, after_plain, atol=1e-10, rtol=0)


def test_a_trimmed_pass_after_a_cache_sees_the_past():
    """Queries offset by the cache's length: the mask-free causal rows HF leaves to sdpa are built right."""
    model = build("llama").eval()
    ids = batch("none")["input_ids"]
    with torch.no_grad():
        caches = [DynamicCache(config=model.config) for _ in range(2)]
        for cache in caches:
            model(input_ids=ids[:, :6], past_key_values=cache, use_cache=True)
        plain = model(input_ids=ids[:, 6:], past_key_values=caches[0], use_cache=True).logits[:, [0, 3, 7]]
        trimmed = trimmed_forward(model, torch.tensor([0, 3, 7]), input_ids=ids[:, 6:], past_key_values=caches[1],
                                  use_cache=True)
    torch.testing.assert_close(trimmed, plain, atol=1e-10, rtol=0)
    torch.testing.assert_close(caches[1].layers[-1].keys, caches[0].layers[-1].keys, atol=1e-10, rtol=0)


def test_lora_model():
    peft = pytest.importorskip("peft")
    model = build("llama")
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj",
                                                                                         "o_proj"]))
    for name, p in lora.named_parameters():  # LoRA B starts at zero: make the adapters act
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    inputs, keep = batch("right"), SUFFIX
    plain = run(lora, lambda: lora(**inputs).logits[:, keep])
    trimmed = run(lora, lambda: trimmed_forward(lora, keep, **inputs))
    torch.testing.assert_close(trimmed[0], plain[0], atol=1e-10, rtol=0)
    assert plain[2] and trimmed[2].keys() == plain[2].keys()
    for name, grad in plain[2].items():
        torch.testing.assert_close(trimmed[2][name], grad, atol=1e-10, rtol=0, msg=name)


def test_gradient_checkpointing_falls_back_to_hf():
    model = build("llama")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert_same(model, batch("right"), SCATTERED, trims=False)


def test_sliding_window_in_effect_falls_back_to_hf():
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=VOCAB, attn_implementation="sdpa", use_sliding_window=True, sliding_window=4,
                         max_window_layers=0, **SMALL)
    model = Qwen2ForCausalLM(config).double().train()
    assert_same(model, batch("right"), SUFFIX, trims=False)


def test_the_layer_forward_is_restored_when_the_forward_fails():
    model = build("llama")

    def fail(*args):
        raise RuntimeError("inside the trimmed layer")

    model.model.layers[-1].mlp.register_forward_pre_hook(fail)
    with pytest.raises(RuntimeError, match="inside the trimmed layer"):
        trimmed_forward(model, SUFFIX, input_ids=batch("none")["input_ids"])
    last = model.model.layers[-1]
    assert "forward" not in last.__dict__ and "forward" not in last.self_attn.__dict__


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_modules_are_called_in_the_plain_forwards_order(kind):
    """ZeRO-3 fetches parameters in module hooks and checks that every rank traced the same module order, so a
    rank that trims (a micro-batch with prompt columns) and one that does not must call the same modules."""
    model = build(kind)
    calls: list[str] = []
    hooks = [m.register_forward_pre_hook(lambda mod, args, name=name: calls.append(name))
             for name, m in model.named_modules()]
    inputs = batch("right")
    model(**inputs)
    plain, calls[:] = list(calls), []
    trimmed_forward(model, SUFFIX, **inputs)
    for hook in hooks:
        hook.remove()
    assert calls == plain and "model.layers.2.self_attn" in calls
