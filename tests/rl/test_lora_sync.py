"""Adapter-only LoRA sync in one process: the flag's modes, the bytes a sync moves, and the engine's log-probs after
a sync against the trainer's (`rlhfkit.rl.weight_sync.LocalWeightSync`, the Transformers engine)."""

from __future__ import annotations

import shlex

import pytest
import torch

from rlhfkit.config.base import parse_config
from rlhfkit.config.lora_sync import lora_sync_mode
from rlhfkit.config.rl import PPOConfig
from rlhfkit.errors import UserError

BASE = "--pretrain m --prompt_data p.jsonl --rollout_batch_size 4 --n_samples_per_prompt 2 --train_batch_size 8 " \
       "--micro_train_batch_size 4 --micro_rollout_batch_size 4 "


def parse(text: str) -> PPOConfig:
    return parse_config(PPOConfig, shlex.split(BASE + text), "test")


@pytest.mark.parametrize("flag, rank, backend, mode", [
    ("auto", 0, "vllm", "full"), ("merged", 0, "transformers", "full"),
    ("auto", 8, "transformers", "adapter"), ("auto", 8, "vllm", "adapter"), ("auto", 2048, "transformers", "adapter"),
    ("merged", 8, "vllm", "merged"), ("adapter", 512, "vllm", "adapter"),
])
def test_modes(flag, rank, backend, mode):
    assert lora_sync_mode(flag, rank, backend) == (mode, None)


def test_auto_falls_back_to_merged_with_one_line_and_adapter_is_refused():
    mode, note = lora_sync_mode("auto", 1024, "vllm")
    assert mode == "merged" and "rank 512" in note and "\n" not in note
    with pytest.raises(UserError, match="--lora_sync adapter: vLLM's LoRA slots go up to rank 512"):
        parse("--lora_rank 1024 --vllm_num_engines 1 --lora_sync adapter")


def test_the_engine_spec_gets_an_adapter_slot_only_for_adapter_sync():
    from rlhfkit.config.rl_specs import engine_spec

    assert engine_spec(parse("--lora_rank 8 --vllm_num_engines 1")).lora_rank == 8
    assert engine_spec(parse("--lora_rank 8 --vllm_num_engines 1")).vllm_lora_slot_rank == 8
    assert engine_spec(parse("--lora_rank 20 --vllm_num_engines 1")).vllm_lora_slot_rank == 32
    assert engine_spec(parse("--lora_rank 8 --lora_sync merged")).lora_rank == 0
    assert engine_spec(parse("")).lora_rank == 0


def test_lora_sync_without_lora_rank_is_refused_when_given():
    with pytest.raises(UserError, match="--lora_sync.*--lora_rank"):
        parse("--lora_sync merged")


def lora_actor(model_dir, zero_stage: int):
    """A LoRA actor (rank 8) whose adapter is not the identity (PEFT starts lora_B at zero)."""
    from rlhfkit.config.rl_specs import actor_spec
    from rlhfkit.rl.roles import ActorRole

    cfg = parse_config(PPOConfig, shlex.split(BASE.replace("--pretrain m", f"--pretrain {model_dir}")
                                              + f"--lora_rank 8 --lora_alpha 16 --zero_stage {zero_stage}"), "test")
    actor = ActorRole(actor_spec(cfg), 1)
    torch.manual_seed(0)
    for name, p in actor.strategy.unwrap(actor.engine).named_parameters():
        if "lora_B" in name:
            with gathered(p), torch.no_grad():
                p.normal_(0, 0.2)
    return actor


def gathered(param):
    """The full parameter, editable, under ZeRO-3; nothing to do otherwise."""
    import contextlib

    if not hasattr(param, "ds_id"):
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters([param], modifier_rank=0)


def hf_engine(model_dir):
    from transformers import AutoTokenizer

    from rlhfkit.rollout.hf_engine import HFRolloutEngine

    tok = AutoTokenizer.from_pretrained(model_dir)
    return HFRolloutEngine.from_pretrained(str(model_dir), tok), tok


@pytest.fixture(scope="module")
def actor_and_engine(demo_assets):
    """A LoRA actor and a Transformers engine on the base model."""
    from tests.helpers import launcher_env_of_one

    with launcher_env_of_one():
        actor = lora_actor(demo_assets.model_dir, 0)
    return (actor, *hf_engine(demo_assets.model_dir))


def engine_vs_actor_gap(actor, engine, tok) -> float:
    """Max |engine log-prob - actor log-prob| over sampled response tokens (temperature 1, fp32)."""
    from rlhfkit.rl.experience import experience_from_samples

    prompts = [[tok.bos_token_id] + tok(f"User: What is {a}+{b}?\nAssistant: ", add_special_tokens=False).input_ids
               for a, b in ((12, 7), (3, 40), (81, 9), (5, 5))]
    samples = engine.generate(prompts, max_new_tokens=8, temperature=1.0, seed=0)
    exp = experience_from_samples(samples, pad_id=tok.pad_token_id)
    got = actor.log_probs(exp)
    mask = exp.action_mask.bool()
    return float((got - exp.rollout_log_probs)[mask].abs().max())


def test_adapter_sync_moves_the_adapter_and_engine_logprobs_equal_the_actors(actor_and_engine):
    from rlhfkit.rl.weight_sync import LocalWeightSync

    actor, engine, tok = actor_and_engine
    base = {n: p for n, p in engine.model.named_parameters()}
    adapter_size = sum(8 * (m.in_features + m.out_features) * 4 for name, m in engine.model.named_modules()
                       if isinstance(m, torch.nn.Linear) and "lm_head" not in name)  # hand count, fp32
    metrics = LocalWeightSync(actor, engine, adapter=True).sync()
    assert metrics["sync/adapter_bytes"] == adapter_size
    assert metrics["sync/bytes"] <= 1.1 * adapter_size
    assert engine.has_adapter_slot
    assert all(base[n] is p for n, p in engine.model.named_parameters() if n in base)  # the base stays in place
    assert engine_vs_actor_gap(actor, engine, tok) <= 1e-4
    with torch.no_grad():  # a new adapter replaces the slot in place
        for name, p in actor.strategy.unwrap(actor.engine).named_parameters():
            if "lora_A" in name:
                p.mul_(-1.5)
    gap_before_sync = engine_vs_actor_gap(actor, engine, tok)
    LocalWeightSync(actor, engine, adapter=True).sync()
    assert gap_before_sync > 1e-2 and engine_vs_actor_gap(actor, engine, tok) <= 1e-4


def test_merged_sync_moves_the_whole_model(actor_and_engine, demo_assets):
    from transformers import AutoModelForCausalLM

    from rlhfkit.rl.weight_sync import LocalWeightSync
    from rlhfkit.rollout.hf_engine import HFRolloutEngine

    actor, _, tok = actor_and_engine
    engine = HFRolloutEngine(AutoModelForCausalLM.from_pretrained(demo_assets.model_dir), tok)
    metrics = LocalWeightSync(actor, engine).sync()
    assert metrics["sync/bytes"] == sum(t.numel() * 4 for t in engine.model.state_dict().values())
    assert "sync/adapter_bytes" not in metrics and not engine.has_adapter_slot
    assert engine_vs_actor_gap(actor, engine, tok) <= 1e-4


def test_zero3_adapter_parameters_are_gathered_for_the_sync(demo_assets, world_of_one):
    from rlhfkit.rl.weight_sync import LocalWeightSync

    actor = lora_actor(demo_assets.model_dir, 3)
    assert any(hasattr(p, "ds_id") for p in actor.strategy.unwrap(actor.engine).parameters())  # sharded
    engine, tok = hf_engine(demo_assets.model_dir)
    metrics = LocalWeightSync(actor, engine, adapter=True).sync()
    assert metrics["sync/bytes"] == metrics["sync/adapter_bytes"] > 0
    assert engine_vs_actor_gap(actor, engine, tok) <= 1e-4
