"""The generator's engine view (rlhfkit/rl/async_generator.py), in process with the real Transformers engine:
chunked generation (--partial_rollout) continues exactly where each chunk stopped, every token carries the policy
version that sampled it, and a weight update taken between chunks shows up as a version change inside responses."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from rlhfkit.config.base import parse_config
from rlhfkit.config.rl import PPOConfig
from rlhfkit.models.loading import load_tokenizer_for
from rlhfkit.rl.async_generator import RolloutGenerator
from rlhfkit.rollout.hf_engine import HFRolloutEngine

REWARD = str(Path(__file__).resolve().parents[1] / "distributed" / "reward_exact_match.py")


def make_generator(assets, chunk: int) -> tuple[RolloutGenerator, HFRolloutEngine]:
    cfg = parse_config(PPOConfig, [
        "--pretrain", str(assets.model_dir), "--prompt_data", str(assets.rl_train), "--remote_rm_url", REWARD,
        "--async_train", "--partial_rollout", "--enable_vllm_is_correction", "--partial_rollout_chunk_len",
        str(chunk), "--reward_workers", "1"], "test")
    engine = HFRolloutEngine.from_pretrained(str(assets.model_dir), load_tokenizer_for(cfg.model))
    return RolloutGenerator(cfg, [], engine, None), engine


def prompts(assets, engine) -> list[list[int]]:
    return [engine.tokenizer.encode(f"User: {r['prompt']}\nAssistant: ") for r in assets.read("rl_train")[:3]]


def test_chunks_continue_exactly_and_record_versions(demo_assets):
    generator, engine = make_generator(demo_assets, chunk=3)
    try:
        ids = prompts(demo_assets, engine)
        whole = engine.generate(ids, max_new_tokens=8, temperature=0.0)
        chunked = generator.engine.generate(ids, max_new_tokens=8, temperature=0.0)
        assert [s.response_ids for s in chunked] == [s.response_ids for s in whole]
        for c, w in zip(chunked, whole):
            assert max(abs(a - b) for a, b in zip(c.logprobs, w.logprobs)) < 1e-4
            assert c.finish_reason == w.finish_reason and c.prompt_ids == w.prompt_ids
            assert c.versions == [0] * len(c.response_ids)
        assert len(generator.intervals["generate"]) == 3  # 3 + 3 + 2 tokens (the demo model never stops early)
        generator.begin_weight_update()
        generator.end_weight_update(1)
        again = generator.engine.generate(ids, max_new_tokens=8, temperature=0.0)
        assert all(s.versions == [1] * len(s.response_ids) for s in again)
    finally:
        generator.stop()


def test_an_update_lands_between_chunks(demo_assets):
    generator, engine = make_generator(demo_assets, chunk=1)
    try:
        ids = prompts(demo_assets, engine)
        out: list = []
        thread = threading.Thread(target=lambda: out.extend(generator.engine.generate(ids, max_new_tokens=24)))
        thread.start()
        while not generator.intervals["generate"]:  # the first chunk is done: update before the next ones
            time.sleep(0.001)
        generator.begin_weight_update()
        generator.end_weight_update(1)
        thread.join(timeout=120)
        for s in out:
            assert len(s.versions) == len(s.response_ids) == 24
            assert s.versions[0] == 0 and s.versions[-1] == 1 and s.versions == sorted(s.versions)
        updates, generates = generator.intervals["update"], generator.intervals["generate"]
        assert all(g1 <= u0 or u1 <= g0 for g0, g1 in generates for u0, u1 in updates)
    finally:
        generator.stop()


def test_agent_episodes_continue_across_an_update_with_per_token_versions(demo_assets):
    """--partial_rollout with an agent on the Transformers engine: a real weight update lands mid-episode; each
    token's version and rollout log-prob are those of the weights that sampled it (tests/rl/partial_agent.py)."""
    from tests.rl.partial_agent import agent_generator, check_versions_and_logprobs, episodes_across_update, perturbed

    engine = HFRolloutEngine.from_pretrained(str(demo_assets.model_dir), load_tokenizer_for(
        parse_config(PPOConfig, ["--pretrain", str(demo_assets.model_dir)], "test").model))
    generator = agent_generator(demo_assets, engine)
    try:
        new_state = perturbed(demo_assets.model_dir)
        episodes = episodes_across_update(generator, prompts(demo_assets, engine),
                                          lambda: engine.update_weights(new_state))
        check_versions_and_logprobs(episodes, demo_assets.model_dir, new_state, atol=1e-4)
        updates, generates = generator.intervals["update"], generator.intervals["generate"]
        assert all(g1 <= u0 or u1 <= g0 for g0, g1 in generates for u0, u1 in updates)
    finally:
        generator.stop()
