"""The Transformers engine inside the actor's process, on the actor's own module (`rlhfkit.rl.actor_engine`): the
same tokens and log-probs as a separate engine holding the same weights, the actor's module left as training needs
it, and which runs share (no Ray: the actor group is stood in for by the role object itself)."""

from __future__ import annotations

import shlex

import pytest
import torch

from rlhfkit.config.base import parse_config
from rlhfkit.config.rl import PPOConfig
from rlhfkit.config.shared_engine import SHARED_ENGINE_ENV, shares_actor_weights
from rlhfkit.rl.actor_engine import ActorEngine

BASE = "--prompt_data p.jsonl --rollout_batch_size 4 --n_samples_per_prompt 2 --train_batch_size 8 " \
       "--micro_train_batch_size 4 --micro_rollout_batch_size 4 --advantage_estimator group_norm " \
       "--actor_num_gpus_per_node 1 --vllm_num_engines 0 --colocate_all_models "


def parse(text: str, model: str = "m") -> PPOConfig:
    return parse_config(PPOConfig, shlex.split(f"--pretrain {model} " + BASE + text), "test")


class OneRank:
    """What `ActorEngine` needs of a `RayActorGroup`, over one role object in this process."""

    def __init__(self, role):
        self.role = role

    def run_on_ranks(self, fn, *args, **kwargs):
        return [fn(self.role, *args, **kwargs)]


@pytest.mark.parametrize("extra, shared", [
    ("", True), ("--bf16", True), ("--zero_stage 3", False), ("--lora_rank 8", False), ("--vllm_num_engines 1", False),
    ("--actor_num_gpus_per_node 2", False),
    ("--backend fsdp2", False), ("--packing_samples", False),
])
def test_which_runs_share_the_actors_module(extra, shared):
    from rlhfkit.config.rl_specs import rl_specs

    specs = rl_specs(parse(extra))
    assert shares_actor_weights(specs, async_train=False) is shared
    # the generator actor of --async_train needs an engine of its own; image prompts keep theirs for now
    assert not shares_actor_weights(specs, async_train=True)
    assert not shares_actor_weights(specs, async_train=False, image_prompts=True)


def test_the_environment_variable_keeps_the_engine_actor(monkeypatch):
    from rlhfkit.config.rl_specs import rl_specs

    assert shares_actor_weights(rl_specs(parse("")), False)
    monkeypatch.setenv(SHARED_ENGINE_ENV, "0")
    assert not shares_actor_weights(rl_specs(parse("")), False)


def test_in_actor_engine_samples_what_a_separate_engine_samples(demo_assets):
    """A real actor role (its weights moved off the checkpoint, as after a step) against the Transformers engine
    actor's class holding a synced copy: the same sampled tokens and log-probs, sampled and greedy."""
    from rlhfkit.config.rl_specs import actor_spec, engine_spec
    from rlhfkit.rl.roles import ActorRole
    from rlhfkit.rollout.hf_engine_actor import HFEngineActor
    from tests.distributed.hf_reference import demo_prompt_ids
    from tests.helpers import launcher_env_of_one

    cfg = parse("", str(demo_assets.model_dir))
    with launcher_env_of_one():
        actor = ActorRole(actor_spec(cfg), 1)
    module = actor.strategy.unwrap(actor.engine)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn_like(p), alpha=0.02)
    separate = HFEngineActor(engine_spec(cfg))
    separate.engine.update_weights(module.state_dict())
    shared = ActorEngine(OneRank(actor), engine_spec(cfg))
    prompts = [p for p in demo_prompt_ids(demo_assets.model_dir, 3) for _ in range(2)]
    actor.engine.train()  # as between the actor's training calls
    assert module.training and all(p.requires_grad for p in module.parameters())
    for sampling in ({"temperature": 1.0, "seed": 7}, {"temperature": 0.0}):
        want = separate.generate(prompts, max_new_tokens=8, **sampling)
        got = shared.generate(prompts, max_new_tokens=8, **sampling)
        assert [s.response_ids for s in got] == [s.response_ids for s in want]
        assert [s.finish_reason for s in got] == [s.finish_reason for s in want]
        gap = max(abs(a - b) for g, w in zip(got, want) for a, b in zip(g.logprobs, w.logprobs))
        assert gap <= 1e-6, gap
    # the actor trains on as before: its module back in training mode, its parameters still trainable
    assert module.training and all(p.requires_grad for p in module.parameters())
    assert shared.sync_from(None) == 0 and shared.engines == []
    assert shared.info()[0]["kind"] == "transformers" and shared.info()[0]["shared_with_actor"]


def test_separate_pools_keep_the_engine_actor():
    """Without --colocate_all_models the engine has a bundle of its own and runs beside the actor: no sharing."""
    from rlhfkit.config.rl_specs import rl_specs

    cfg = parse_config(PPOConfig, shlex.split("--pretrain m " + BASE.replace("--colocate_all_models", "")), "test")
    assert not shares_actor_weights(rl_specs(cfg), False)
