"""`rlhfkit.planner.engine_rows`: the Transformers engine that runs inside the actor (`rlhfkit/rl/actor_engine.py`)
is planned as the runtime runs it: no weights of its own, no process of its own, only its KV cache in the actor's
pool; the separate engine (RLHFKIT_SHARED_ENGINE=0, 2 actor ranks) and train_ppo's in-process engine keep their
copy. The planner and the runtime ask the same function. Plans are made from a config.json only (Llama-2-7B)."""

from __future__ import annotations

import shlex

import pytest

from rlhfkit.config.base import parse_config
from rlhfkit.config.rl import PPOConfig
from rlhfkit.config.rl_specs import rl_specs
from rlhfkit.config.shared_engine import SHARED_ENGINE_ENV, run_shares_actor_weights
from rlhfkit.planner.engine_rows import IN_ACTOR, engine_member
from rlhfkit.planner.memory import GIB, MIB
from rlhfkit.planner.plan import CPU_PROCESS_BASELINE, Devices, build_plan
from tests.planner.memory_shapes import LLAMA2_7B, write_config

GPU = Devices("gpu", 80 * GIB, 1, "test")
CPU = Devices("cpu", 512 * GIB, 1, "test")
# 8 samples (4 prompts x 2) of 100 + 27 + 1 = 128 tokens, bf16
BASE = "--prompt_data p.jsonl --rollout_batch_size 4 --n_samples_per_prompt 2 --train_batch_size 8 " \
       "--micro_train_batch_size 4 --micro_rollout_batch_size 4 --advantage_estimator group_norm --bf16 " \
       "--prompt_max_len 100 --generate_max_len 27 --actor_num_gpus_per_node 1 --vllm_num_engines 0 " \
       "--colocate_all_models "
# By hand: keys + values x 32 layers x 32 KV heads x head dim 128 x 2 bytes = 0.5 MiB per token; x 8 x 128 tokens
KV_BYTES = 2 * 32 * 32 * 128 * 2 * 8 * 128
WEIGHTS_BYTES = 6_738_415_616 * 2  # Llama-2-7B's parameters in bf16


@pytest.fixture
def model(tmp_path) -> str:
    return str(write_config(tmp_path / "llama", LLAMA2_7B))


def parse(model: str, extra: str = "") -> PPOConfig:
    return parse_config(PPOConfig, shlex.split(f"--pretrain {model} {BASE}{extra}"), "test")


def engine_rows_of(plan) -> tuple[list[str], dict[tuple[str, str], object]]:
    pool = next(p for p in plan.pools if "actor" in p.members)
    return pool.members, {(r.role, r.component): r for r in pool.rows}


def test_shared_engine_plans_no_weights_and_its_kv_cache_in_the_actor(model):
    assert KV_BYTES == 512 * MIB
    members, rows = engine_rows_of(build_plan(parse(model), "ppo_ray", GPU))
    assert IN_ACTOR in members and "hf_engine" not in members
    assert not [key for key in rows if key[0] in ("hf_engine", IN_ACTOR)]  # no engine weights row
    kv = rows[("actor", "KV cache (engine in actor)")]
    assert (kv.bytes, kv.phase, kv.transient) == (KV_BYTES, "generate", False)


@pytest.mark.parametrize("how", ["env", "two actor ranks"])
def test_separate_engine_keeps_its_copy(model, monkeypatch, how):
    if how == "env":
        monkeypatch.setenv(SHARED_ENGINE_ENV, "0")
        cfg = parse(model)
    else:
        cfg = parse(model, "--actor_num_gpus_per_node 2")
    plan = build_plan(cfg, "ppo_ray", GPU)
    members = [m for p in plan.pools for m in p.members]
    rows = {(r.role, r.component): r for p in plan.pools for r in p.rows}
    assert "hf_engine" in members and IN_ACTOR not in members
    assert rows[("hf_engine", "weights")].bytes == WEIGHTS_BYTES
    assert rows[("hf_engine", "KV cache")].bytes == KV_BYTES


def test_on_the_host_the_shared_engine_has_no_process(model, monkeypatch):
    shared = build_plan(parse(model), "ppo_ray", CPU)
    monkeypatch.setenv(SHARED_ENGINE_ENV, "0")
    separate = build_plan(parse(model), "ppo_ray", CPU)
    # one process (its baseline) and one copy of the weights fewer; the KV cache is the same
    assert separate.total() - shared.total() == pytest.approx(CPU_PROCESS_BASELINE + WEIGHTS_BYTES)


def test_turns_hold_the_actors_states_while_it_generates(model):
    """--deepspeed_enable_sleep reloads the actor's states for its engine's generate call: the KV cache counts in
    the actor's turn, as the largest of its transient uses (it and training activations never coexist)."""
    plan = build_plan(parse(model, "--deepspeed_enable_sleep --gradient_checkpointing --micro_train_batch_size 1"),
                      "ppo_ray", GPU)
    pool = next(p for p in plan.pools if "actor" in p.members)
    actor = [r for r in pool.rows if r.role == "actor" and r.phase == "train"]
    kv = next(r for r in actor if r.component.startswith("KV cache"))
    assert kv.transient and pool.turns
    fixed = sum(r.bytes for r in actor if not r.transient)
    acts = next(r for r in actor if r.component == "activations")
    assert kv.bytes > acts.bytes  # so the actor's turn holds its states and the KV cache, not both transients
    assert pool.phase_bytes("train") == fixed + kv.bytes


def test_train_ppos_in_process_engine_holds_a_copy(model):
    """train_ppo's engine loads the policy itself and gets the actor's weights copied in (LocalWeightSync)."""
    rows = {(r.role, r.component): r for r in build_plan(parse(model), "ppo", GPU).pools[0].rows}
    assert rows[("hf_engine", "weights")].bytes == WEIGHTS_BYTES


@pytest.mark.parametrize("extra", ["", "--zero_stage 3", "--lora_rank 8", "--actor_num_gpus_per_node 2",
                                   "--packing_samples", "--async_train"])
def test_the_planner_and_the_runtime_ask_the_same_rule(model, extra):
    from rlhfkit.rl import ray_run

    assert ray_run.run_shares_actor_weights is run_shares_actor_weights  # check_ray_config's decision
    cfg = parse(model, extra)
    shared = run_shares_actor_weights(cfg, rl_specs(cfg))
    assert shared is (extra == "")
    assert (engine_member(cfg, "hf_engine") == IN_ACTOR) is shared
