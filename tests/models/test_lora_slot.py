"""The LoRA adapter slot of a rollout engine (adapter-only sync): names, in-place replacement, sizes."""

from __future__ import annotations

import copy

import pytest
import torch

from rlhfkit.models.lora import apply_lora
from rlhfkit.models.lora_slot import (
    adapter_config,
    inject_adapter_slot,
    is_adapter_parameter,
    load_adapter_tensors,
    pack,
    payload_bytes,
    slot_name,
    unpack,
    wire_name,
    write_adapter_dir,
)

RANK = 4


@pytest.fixture(scope="module")
def base(demo_assets):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(demo_assets.model_dir, dtype=torch.float32).eval()


def randomized_adapter(base, seed: int):
    """A PEFT model of `base` whose adapter is not the identity (PEFT starts lora_B at zero)."""
    torch.manual_seed(seed)
    peft_model = apply_lora(copy.deepcopy(base), RANK, 8, 0.0, None).eval()
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
    return peft_model


def wire_tensors(peft_model) -> dict[str, torch.Tensor]:
    return {wire_name(n): p.detach().clone() for n, p in peft_model.named_parameters() if is_adapter_parameter(n)}


def test_names_follow_peft_checkpoints_and_map_back_to_the_slot():
    param = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"
    assert wire_name(param) == "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    assert slot_name(wire_name(param)) == "model.layers.0.self_attn.q_proj.lora_A.default.weight"
    embedding = "base_model.model.model.embed_tokens.lora_embedding_B.default"
    assert wire_name(embedding) == "base_model.model.model.embed_tokens.lora_embedding_B"
    assert slot_name(wire_name(embedding)) == "model.embed_tokens.lora_embedding_B.default"
    assert not is_adapter_parameter("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight")


def test_wire_names_are_what_peft_saves(base, tmp_path):
    peft_model = randomized_adapter(base, 0)
    peft_model.save_pretrained(tmp_path)
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / "adapter_model.safetensors"))
    sent = wire_tensors(peft_model)
    assert set(saved) == set(sent)
    written = write_adapter_dir(tmp_path / "slot", adapter_config(peft_model), sent)
    assert set(load_file(str(written / "adapter_model.safetensors"))) == set(saved)


def test_adapter_size_is_rank_times_in_plus_out(base):
    """Hand count: every linear layer of the decoder (not the LM head) gets A [r, in] and B [out, r] in fp32."""
    peft_model = randomized_adapter(base, 0)
    linears = [m for name, m in base.named_modules() if isinstance(m, torch.nn.Linear) and "lm_head" not in name]
    expected = sum(RANK * (m.in_features + m.out_features) * 4 for m in linears)
    assert payload_bytes(wire_tensors(peft_model)) == expected
    assert expected < 0.2 * sum(p.numel() * 4 for p in base.parameters())


def test_slot_replaced_in_place_gives_the_peft_models_logits(base):
    engine_model = copy.deepcopy(base)
    ids = torch.tensor([[1, 5, 6, 7, 8, 9]])
    for seed in (1, 2):  # the second load replaces the first adapter in the same slot
        peft_model = randomized_adapter(base, seed)
        if seed == 1:
            inject_adapter_slot(engine_model, adapter_config(peft_model))
        slot_params = {n: p for n, p in engine_model.named_parameters() if is_adapter_parameter(n)}
        assert load_adapter_tensors(engine_model, wire_tensors(peft_model)) == len(slot_params)
        assert {n: p for n, p in engine_model.named_parameters() if is_adapter_parameter(n)} == slot_params
        with torch.no_grad():
            expected, got, plain = peft_model(ids).logits, engine_model.eval()(ids).logits, base(ids).logits
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
        assert (got - plain).abs().max() > 1e-2  # the adapter acts


def test_an_adapter_that_does_not_fit_the_slot_is_refused(base):
    engine_model = copy.deepcopy(base)
    peft_model = randomized_adapter(base, 0)
    inject_adapter_slot(engine_model, adapter_config(peft_model))
    tensors = wire_tensors(peft_model)
    tensors.pop(next(iter(tensors)))
    with pytest.raises(ValueError, match="does not fit the engine's slot"):
        load_adapter_tensors(engine_model, tensors)


def test_pack_and_unpack_round_trip_with_one_buffer_per_dtype():
    g = torch.Generator().manual_seed(0)
    tensors = {"a.lora_A.weight": torch.randn(4, 6, generator=g), "a.lora_B.weight": torch.randn(6, 4, generator=g),
               "b.lora_A.weight": torch.randn(2, 3, generator=g).to(torch.bfloat16)}
    flat, index = pack(tensors)
    assert {k: v.numel() for k, v in flat.items()} == {"float32": 48, "bfloat16": 6}
    back = unpack(flat, index)
    assert list(back) == list(tensors)
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t)
