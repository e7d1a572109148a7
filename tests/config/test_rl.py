"""Role device counts of the RL config: OpenRLHF's 0-node roles are accepted where the role is absent or
colocated, and rejected (one line) where the role is needed and has no devices."""

from __future__ import annotations

import re
import shlex

import pytest

from rlhfkit.config.base import parse_config
from rlhfkit.config.rl import PPOConfig, role_needed, role_ranks
from rlhfkit.config.rl_specs import placement_spec
from rlhfkit.distributed.placement import ResourcePlan, role_demands
from rlhfkit.errors import UserError
from tests.helpers import error_lines

BASE = ("--pretrain m --prompt_data p.jsonl --rollout_batch_size 16 --n_samples_per_prompt 2 "
        "--train_batch_size 32 --micro_train_batch_size 2 --micro_rollout_batch_size 2 ")
# Seed 001's two-node hybrid-engine command: every role but the actor has 0 nodes and 0 GPUs.
SEED_TWO_NODE_HYBRID = ("--colocate_all_models --vllm_enable_sleep --deepspeed_enable_sleep "
                        "--actor_num_nodes 2 --actor_num_gpus_per_node 8 "
                        "--critic_num_nodes 0 --critic_num_gpus_per_node 0 "
                        "--reward_num_nodes 0 --reward_num_gpus_per_node 0 "
                        "--ref_num_nodes 0 --ref_num_gpus_per_node 0 "
                        "--vllm_num_engines 4 --vllm_tensor_parallel_size 4 ")


def checked(cfg: PPOConfig) -> PPOConfig:
    """A parsed config (its flags validated by parse_config) whose inputs are there too (what the trainer checks)."""
    cfg.check_inputs()
    return cfg


def cfg(text: str) -> PPOConfig:
    return checked(parse_config(PPOConfig, shlex.split(BASE + text), "t"))


def test_seed_two_node_hybrid_engine_puts_zero_node_roles_on_the_actor():
    c = cfg(SEED_TWO_NODE_HYBRID + "--reward_pretrain rm --advantage_estimator gae")
    assert [role_ranks(c, r) for r in ("actor", "critic", "ref", "reward")] == [16, 16, 16, 16]
    plan = ResourcePlan.make(role_demands(placement_spec(c)), colocate_all=True)
    assert [(p.name, p.bundles, sorted(p.members)) for p in plan.pools] == [
        ("hybrid", 16, ["actor", "critic", "ref", "reward", "vllm"])]
    assert [s.bundle_index for s in plan.slots["critic"]] == list(range(16))
    assert plan.slots["critic"][0].num_cpus == pytest.approx(1 / 5)  # five members share each bundle


@pytest.mark.parametrize("text, absent", [
    ("--advantage_estimator group_norm --remote_rm_url http://127.0.0.1:5000/get_reward --init_kl_coef 0 "
     "--critic_num_nodes 0 --reward_num_gpus_per_node 0 --ref_num_nodes 0", {"critic", "reward", "ref"}),
    ("--advantage_estimator rloo --reward_pretrain rm --critic_num_gpus_per_node 0", {"critic"}),
])
def test_zero_devices_for_absent_roles(text, absent):
    c = cfg(text)
    assert {r for r in ("critic", "ref", "reward") if not role_needed(c, r)} == absent
    assert {d.name for d in role_demands(placement_spec(c))} & absent == set()


def test_colocated_reference_and_reward_follow_their_host():
    c = cfg("--reward_pretrain rm --colocate_actor_ref --colocate_critic_reward --actor_num_gpus_per_node 2 "
            "--ref_num_nodes 0 --critic_num_gpus_per_node 4 --reward_num_gpus_per_node 0")
    assert (role_ranks(c, "ref"), role_ranks(c, "reward")) == (2, 4)
    pools = {p.name: (p.bundles, p.members) for p in ResourcePlan.make(
        role_demands(placement_spec(c)), colocate_actor_ref=True, colocate_critic_reward=True).pools}
    assert pools["actor_ref"] == (2, ["actor", "ref"]) and pools["critic_reward"] == (4, ["critic", "reward"])


@pytest.mark.parametrize("text, needle", [
    ("--reward_pretrain rm --critic_num_nodes 0",
     "--critic_num_nodes 0 --critic_num_gpus_per_node 1: the critic role has no devices but --advantage_estimator "
     "gae trains a critic"),
    ("--remote_rm_url http://127.0.0.1:5000/get_reward --advantage_estimator group_norm --ref_num_gpus_per_node 0",
     "the ref role has no devices but the KL term"),
    ("--reward_pretrain rm --advantage_estimator group_norm --reward_num_nodes 0", "the reward role has no devices"),
    ("--reward_pretrain rm --colocate_critic_reward --advantage_estimator gae --critic_num_nodes 0",
     "the critic role has no devices"),
    ("--reward_pretrain rm --actor_num_nodes 0", "--actor_num_nodes must be positive (got 0)"),
    ("--reward_pretrain rm --ref_num_nodes -1 --colocate_all_models", "device counts must be >= 0"),
])
def test_needed_role_without_devices_fails(text, needle):
    with pytest.raises(UserError) as e:
        cfg(text)
    assert needle in str(e.value) and "\n" not in str(e.value)


ASYNC_BASE = "--remote_rm_url http://127.0.0.1:1/get_reward "


@pytest.mark.parametrize("text, needle", [
    ("--async_queue_size 2", "--async_queue_size applies to asynchronous training; add --async_train"),
    ("--partial_rollout", "--partial_rollout applies to asynchronous training"),
    ("--vllm_generate_batch_size 32", "--vllm_generate_batch_size applies to asynchronous training"),
    ("--async_train --async_queue_size 0", "--async_queue_size must be >= 1"),
    ("--async_train --partial_rollout", "needs the importance-sampling correction: add --enable_vllm_is_correction"),
    ("--async_train --partial_rollout --enable_vllm_is_correction --partial_rollout_chunk_len 0",
     "--partial_rollout_chunk_len must be positive"),
    ("--async_train --vllm_generate_batch_size 16", "must be a multiple of --rollout_batch_size 16 above it"),
    ("--async_train --vllm_generate_batch_size 40", "must be a multiple of --rollout_batch_size 16 above it"),
    ("--async_train --vllm_generate_batch_size 32", "makes 2 batches per engine call, more than --async_queue_size 1"),
    ("--async_train --async_queue_size 2 --vllm_generate_batch_size 32 --n_samples_per_prompt 4 --dynamic_filtering",
     "--vllm_generate_batch_size with --dynamic_filtering is not supported yet"),
    ("--async_train --vllm_enable_sleep", "the engines never sleep; drop --vllm_enable_sleep"),
])
def test_async_flags_are_checked(text, needle):
    with pytest.raises(UserError, match=re.escape(needle)):
        cfg(ASYNC_BASE + text)


def test_async_flags_accepted():
    a = cfg(ASYNC_BASE + "--async_train --async_queue_size 2 --partial_rollout --enable_vllm_is_correction "
                         "--vllm_generate_batch_size 32").asynchronous
    assert (a.async_train, a.async_queue_size, a.partial_rollout, a.vllm_generate_batch_size) == (True, 2, True, 32)


def test_single_process_train_ppo_refuses_async(capsys):
    from rlhfkit.cli.common import run_cli
    from rlhfkit.cli.train_ppo import main

    code = run_cli(main, shlex.split(BASE + ASYNC_BASE + "--async_train"), prog="train_ppo")
    err = error_lines(capsys.readouterr().err)
    assert code == 2 and len(err) == 1 and "python -m rlhfkit.cli.train_ppo_ray" in err[0], err


def test_partial_rollout_accepts_agents():
    from pathlib import Path

    agent = Path(__file__).resolve().parents[2] / "examples" / "agent_func.py"
    a = cfg(f"--async_train --partial_rollout --enable_vllm_is_correction --agent_func_path {agent}").asynchronous
    assert a.partial_rollout
