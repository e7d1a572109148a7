"""Agent episodes across a weight update with --partial_rollout, on any engine (the Transformers engine in
tests/rl/test_async_generator.py, vLLM in tests/rollout/test_vllm_engine.py): the generator's engine view runs
episodes of tests/rl/agent_short_turns.py while a real weight update lands mid-episode; every token's version and
rollout log-prob are then checked against an independent Transformers forward with that version's weights."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import torch

from rlhfkit.config.base import parse_config
from rlhfkit.config.rl import PPOConfig
from rlhfkit.rl.async_generator import RolloutGenerator
from tests.distributed.hf_reference import hf_token_logprobs, load_with_state

AGENT = str(Path(__file__).resolve().parent / "agent_short_turns.py")
BUDGET = 24  # response tokens of an episode: 4-token turns and their feedback


def agent_generator(assets, engine: Any, chunk: int = 2) -> RolloutGenerator:
    cfg = parse_config(PPOConfig, [
        "--pretrain", str(assets.model_dir), "--prompt_data", str(assets.rl_train), "--agent_func_path", AGENT,
        "--async_train", "--partial_rollout", "--enable_vllm_is_correction", "--partial_rollout_chunk_len",
        str(chunk), "--max_steps", "4", "--generate_max_len", str(BUDGET)], "test")
    return RolloutGenerator(cfg, [], engine, None)


def perturbed(model_dir) -> dict[str, torch.Tensor]:
    """The policy after a (large, so that versions are told apart) update: every weight moved by noise."""
    gen = torch.Generator().manual_seed(5)
    state = load_with_state(model_dir).state_dict()
    return {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in state.items() if k != "lm_head.weight"}


class _UpdateAfterFirstCall:
    """The engine, whose first generate call asks for a weight update before it returns: the update then lands
    before the next call, i.e. between the first two chunks of the episodes' first turn."""

    def __init__(self, engine: Any, generator: RolloutGenerator):
        self.engine, self.generator, self.fired = engine, generator, threading.Event()

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        out = self.engine.generate(*args, **kwargs)
        if not self.fired.is_set():
            self.generator.update_pending.set()  # what begin_weight_update does first: the next call waits
            self.fired.set()
        return out


def episodes_across_update(generator: RolloutGenerator, prompt_ids: list[list[int]], update) -> list[dict]:
    """Run one episode per prompt; after the first engine call, `update()` (new weights, version 1) lands."""
    requests = [{"prompt": f"p{i}", "prompt_ids": ids, "label": None} for i, ids in enumerate(prompt_ids)]
    hook = generator.engine.engine = _UpdateAfterFirstCall(generator.engine.engine, generator)
    out: list[dict] = []
    thread = threading.Thread(target=lambda: out.extend(generator.engine.generate_episodes(
        requests, AGENT, max_steps=4, max_length=BUDGET, step_timeout=60, agent_workers=0, temperature=1.0,
        top_p=1.0, top_k=-1, seed=3)))
    thread.start()
    assert hook.fired.wait(120)
    generator.begin_weight_update()
    try:
        update()
    finally:
        generator.end_weight_update(1)
    thread.join(timeout=120)
    generator.engine.engine = hook.engine
    assert len(out) == len(requests)
    return out


def check_versions_and_logprobs(episodes: list[dict], model_dir, new_state: dict, atol: float) -> None:
    """Each action token's rollout log-prob is that of the policy version it is stamped with (the IS correction's
    behaviour policy, token by token); the episodes span the update (version 0 first, version 1 later, turns after
    the first included); feedback tokens carry the version of the token before them."""
    models = {0: load_with_state(model_dir), 1: load_with_state(model_dir, new_state)}
    for e in episodes:
        versions, mask, response = e["versions"], e["action_mask"], e["response_ids"]
        assert e["turns"] >= 2 and e["feedback_tokens"] > 0, e
        assert len(versions) == len(response) and versions == sorted(versions), versions
        assert versions[0] == 0 and versions[-1] == 1, versions
        for i, m in enumerate(mask):
            if not m:
                assert versions[i] == versions[i - 1]
        turns, start = [], 0  # (start, end) of each run of action tokens
        for i in range(len(mask) + 1):
            if i == len(mask) or not mask[i]:
                if i > start:
                    turns.append((start, i))
                start = i + 1
        assert versions[turns[-1][0]] == 1  # a later turn continued with the new weights
        first = versions[turns[0][0]:turns[0][1]]
        assert 0 in first and 1 in first  # and so did the first turn, mid-way (between its chunks)
        for lo, hi in turns:
            for v in set(versions[lo:hi]):
                ref = hf_token_logprobs(models[v], e["prompt_ids"] + response[:lo], response[lo:hi])
                got = torch.tensor(e["logprobs"][lo:hi], dtype=torch.float64)
                stamped = torch.tensor([x == v for x in versions[lo:hi]])
                assert torch.allclose(got[stamped], ref[stamped], atol=atol), (v, got, ref)
                other = hf_token_logprobs(models[1 - v], e["prompt_ids"] + response[:lo], response[lo:hi])
                assert (got[stamped] - other[stamped]).abs().max() > 10 * atol  # the versions are told apart
