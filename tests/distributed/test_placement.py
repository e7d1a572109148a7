"""Placement arithmetic (no Ray): which roles share a placement group and what each rank asks for."""

from __future__ import annotations

import sys

import pytest

from rlhfkit.distributed.placement import ResourcePlan, RoleDemand, bundle_cpus, plan_pools

SEED_HYBRID = [RoleDemand("actor", 8), RoleDemand("ref", 8), RoleDemand("critic", 8), RoleDemand("reward", 8),
               RoleDemand("vllm", 4, devices_per_rank=2)]


def test_hybrid_engine_puts_everything_on_the_actor_devices():
    plan = ResourcePlan.make(SEED_HYBRID, colocate_all=True, use_gpu=True, cpus_per_bundle=1)
    assert [(p.name, p.bundles, p.members) for p in plan.pools] == [
        ("hybrid", 8, ["actor", "ref", "critic", "reward", "vllm"])]
    assert plan.total() == {"CPU": 8.0, "GPU": 8.0}
    actor = plan.slots["actor"]
    assert [s.bundle_index for s in actor] == list(range(8))
    assert actor[0].num_gpus == pytest.approx(0.2) and actor[0].num_cpus == pytest.approx(0.2)
    vllm = plan.slots["vllm"]  # engine i spans bundles 2i, 2i+1
    assert [(s.bundle_index, s.bundle_count) for s in vllm] == [(0, 2), (2, 2), (4, 2), (6, 2)]


def test_no_colocation_gives_every_role_its_own_pool_on_cpu():
    plan = ResourcePlan.make([RoleDemand("actor", 2), RoleDemand("ref", 1), RoleDemand("critic", 1),
                              RoleDemand("vllm", 2)], use_gpu=False, cpus_per_bundle=1)
    assert [(p.name, p.bundles) for p in plan.pools] == [("actor", 2), ("ref", 1), ("critic", 1), ("vllm", 2)]
    assert plan.total() == {"CPU": 6.0}
    assert all(s.num_gpus == 0 and s.num_cpus == 1 for slots in plan.slots.values() for s in slots)


def test_pairwise_colocation_shares_bundles_half_each():
    demands = [RoleDemand("actor", 2), RoleDemand("ref", 2), RoleDemand("critic", 2), RoleDemand("reward", 1)]
    plan = ResourcePlan.make(demands, colocate_actor_ref=True, colocate_critic_reward=True, cpus_per_bundle=1)
    assert [(p.name, p.bundles, p.members) for p in plan.pools] == [
        ("actor_ref", 2, ["actor", "ref"]), ("critic_reward", 2, ["critic", "reward"])]
    assert {s.num_cpus for s in plan.slots["ref"]} == {0.5}
    assert [s.bundle_index for s in plan.slots["reward"]] == [0]


def test_hybrid_engine_device_mismatch_is_a_bug_here():
    """The config layer refuses the flags (tests/config/test_rl.py); a plan that gets here anyway is a bug."""
    with pytest.raises(ValueError, match=r"--colocate_all_models: actor devices 2 != vLLM devices 1"):
        plan_pools([RoleDemand("actor", 2), RoleDemand("vllm", 1)], colocate_all=True, colocate_actor_ref=False,
                   colocate_critic_reward=False)


def test_colocated_guest_larger_than_owner_is_a_bug_here():
    with pytest.raises(ValueError, match="--colocate_actor_ref: ref needs 4 devices but the actor has 2"):
        plan_pools([RoleDemand("actor", 2), RoleDemand("ref", 4)], colocate_all=False, colocate_actor_ref=True,
                   colocate_critic_reward=False)


def test_threads_follow_the_bundle_cpus_and_colocated_roles_share_them():
    from rlhfkit.distributed.ray_groups import worker_env

    plan = ResourcePlan.make([RoleDemand("actor", 2), RoleDemand("ref", 2), RoleDemand("vllm", 1, devices_per_rank=2)],
                             colocate_all=True, cpus_per_bundle=2)
    actor, engine = plan.slots["actor"][0], plan.slots["vllm"][0]
    assert actor.num_cpus == pytest.approx(2 / 3) and actor.threads == 2  # takes turns with ref and the engine
    assert engine.threads == 4  # a tensor-parallel engine spans two bundles
    assert worker_env(slot=actor)["OMP_NUM_THREADS"] == "2" and worker_env(slot=engine)["MKL_NUM_THREADS"] == "4"
    assert worker_env()["OMP_NUM_THREADS"] == "1"
    half = ResourcePlan.make([RoleDemand("actor", 1)], cpus_per_bundle=0.5)
    assert half.slots["actor"][0].threads == 1


@pytest.mark.parametrize("bundles, cores, omp, env, use_gpu, ray_address, expected", [
    (1, 2, None, None, False, None, 2.0),    # the hybrid engine on a 2-core machine: both cores, roles take turns
    (1, 2, "1", None, False, None, 1.0),     # OMP_NUM_THREADS caps the threads a user gave each process
    (5, 2, None, None, False, None, 1.0),    # five separate bundles run at once: at least 1 each
    (2, 16, "4", None, False, None, 4.0),    # 16 cores over 2 bundles = 8, capped at 4
    (1, 2, None, "3", False, None, 3.0),     # RLHFKIT_RAY_CPUS_PER_BUNDLE wins
    (1, 16, None, None, True, None, 1.0),    # GPU bundles keep 1 CPU
    (1, 16, None, None, False, "auto", 1.0),  # a joined cluster: its nodes are not this driver's
])
def test_bundle_cpus_default(monkeypatch, bundles, cores, omp, env, use_gpu, ray_address, expected):
    import rlhfkit.distributed.placement as placement

    monkeypatch.setattr(placement.os, "cpu_count", lambda: cores)
    monkeypatch.delitem(sys.modules, "ray", raising=False)  # a test cluster of this worker would count as joined
    for key, value in (("OMP_NUM_THREADS", omp), ("RLHFKIT_RAY_CPUS_PER_BUNDLE", env), ("RAY_ADDRESS", ray_address)):
        if value is None:
            monkeypatch.delenv(key, raising=False)
        else:
            monkeypatch.setenv(key, value)
    assert bundle_cpus(bundles, use_gpu) == expected
