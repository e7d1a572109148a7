"""RayActorGroup on a real local Ray cluster: placement bundles, a gloo world inside the actors, dispatch."""

from __future__ import annotations

import pytest
import torch

from rlhfkit.distributed.placement import ResourcePlan, RoleDemand
from rlhfkit.distributed.ray_groups import RayActorGroup, join_from_ranks, split_for_ranks
from tests.distributed.toy_roles import EchoRole


def test_split_and_join_are_inverse_in_order():
    items = [[i] * (i % 3 + 1) for i in range(7)]
    parts = split_for_ranks(items, 3)
    assert [len(p) for p in parts] == [3, 2, 2]
    assert join_from_ranks(parts) == items
    t = torch.arange(10).reshape(5, 2)
    assert torch.equal(join_from_ranks(split_for_ranks(t, 2)), t)
    d = split_for_ranks({"a": t, "b": list(range(5))}, 2)
    assert d[1]["b"] == [3, 4] and torch.equal(d[1]["a"], t[3:])
    assert join_from_ranks([{"loss": 1.0, "n": [1]}, {"loss": 3.0, "n": [2]}]) == {"loss": 2.0, "n": [1, 2]}


def test_two_colocated_groups_form_their_own_gloo_worlds(ray_cluster):
    ray = ray_cluster
    plan = ResourcePlan.make([RoleDemand("actor", 2), RoleDemand("ref", 2)], colocate_actor_ref=True,
                             use_gpu=False, cpus_per_bundle=1).create()
    try:
        actor = RayActorGroup("actor", EchoRole, plan, plan.slots["actor"], init_kwargs={"scale": 1.0})
        ref = RayActorGroup("ref", EchoRole, plan, plan.slots["ref"], init_kwargs={"scale": 10.0})
        where = [ray.get(w.call.remote("where", (), {})) for w in actor.workers]
        ref_where = [ray.get(w.call.remote("where", (), {})) for w in ref.workers]
        for rank, (a, r) in enumerate(zip(where, ref_where)):
            assert (a["rank"], a["world"], a["env_rank"], a["backend"]) == (rank, 2, rank, "gloo")
            assert a["master"] == "127.0.0.1" and a["threads"] == 1
            # Both roles sit on the same bundle of the same placement group, half a CPU each.
            assert a["pg"] == r["pg"] == plan.groups["actor_ref"].id.hex()
            assert a["resources"] == {"CPU": pytest.approx(0.5)}
        assert len({w["pid"] for w in where + ref_where}) == 4
        assert actor.all_ranks() == [0, 1] and ref.all_ranks() == [0, 1]
        # split: rank 0 gets rows 0-2, rank 1 rows 3-4, results joined in order
        batch = torch.arange(10.0).reshape(5, 2)
        assert torch.equal(actor.double(batch), batch * 2) and torch.equal(ref.double(batch), batch * 20)
        out = actor.lengths([[1], [2, 2], [3, 3, 3]])
        assert out["lengths"] == [1, 2, 3] and out["ranks"] == [0, 0, 1]
        assert not hasattr(actor, "no_such_method") and hasattr(actor, "all_ranks")
        actor.kill()
        ref.kill()
    finally:
        plan.remove()


def test_colocated_roles_run_as_many_threads_as_their_bundle_has_cpus(ray_cluster):
    ray = ray_cluster
    plan = ResourcePlan.make([RoleDemand("actor", 1), RoleDemand("ref", 1)], colocate_actor_ref=True,
                             use_gpu=False, cpus_per_bundle=2).create()
    try:
        groups = [RayActorGroup(name, EchoRole, plan, plan.slots[name]) for name in ("actor", "ref")]
        for group in groups:
            where = ray.get(group.workers[0].call.remote("where", (), {}))
            assert where["threads"] == 2 and where["resources"] == {"CPU": pytest.approx(1.0)}
            group.kill()
    finally:
        plan.remove()


def test_dead_or_stuck_role_error_names_the_role_and_the_cause_within_seconds(ray_cluster):
    """A role whose Ray actor dies mid-run, or stops answering past --ray_call_timeout, stops the caller with
    ComponentFailed naming the role and the cause, instead of a hang."""
    import time

    from rlhfkit.distributed.ray_groups import ray_get, set_call_timeout
    from rlhfkit.errors import ComponentFailed

    ray = ray_cluster
    plan = ResourcePlan.make([RoleDemand("actor", 1)], use_gpu=False, cpus_per_bundle=1).create()
    try:
        actor = RayActorGroup("actor", EchoRole, plan, plan.slots["actor"])
        assert actor.all_ranks() == [0]
        set_call_timeout(2.0)
        slow = [w.run.remote(lambda role: time.sleep(30), (), {}) for w in actor.workers]
        started = time.monotonic()
        with pytest.raises(ComponentFailed, match=r"^slow actor: no answer within --ray_call_timeout 2 s"):
            ray_get(slow, "slow actor")
        assert time.monotonic() - started < 10
        ray.kill(actor.workers[0])  # the role's process dies mid-run
        started = time.monotonic()
        with pytest.raises(ComponentFailed, match=r"^the actor role \(all_ranks\): its Ray actor died \(.*Error"):
            actor.all_ranks()
        assert time.monotonic() - started < 60
    finally:
        set_call_timeout(None)
        plan.remove()


def test_rank_left_waiting_in_a_collective_stops_after_ddp_timeout(ray_cluster):
    """--ddp_timeout reaches the process group of a role's Ray ranks (through the env the run gives the group): a
    rank whose peer never arrives at a collective stops the caller after it, with the flag named, not a hang."""
    import time

    from rlhfkit.distributed.launch import DIST_TIMEOUT_ENV
    from rlhfkit.errors import ComponentFailed

    def rank1_absent(role):
        if dist_rank() == 1:
            time.sleep(60)  # never arrives
            return None
        return role.all_ranks()

    def dist_rank() -> int:
        import torch.distributed as dist

        return dist.get_rank()

    plan = ResourcePlan.make([RoleDemand("actor", 2)], use_gpu=False, cpus_per_bundle=1).create()
    try:
        actor = RayActorGroup("actor", EchoRole, plan, plan.slots["actor"], env={DIST_TIMEOUT_ENV: "3"})
        assert actor.all_ranks() == [0, 1]
        started = time.monotonic()
        with pytest.raises(ComponentFailed, match=r"^the actor role: a torch\.distributed collective waited past "
                                                  r"--ddp_timeout.*Timed out waiting 3000ms"):
            actor.run_on_ranks(rank1_absent)
        assert 2.5 <= time.monotonic() - started < 40
        actor.kill()
    finally:
        plan.remove()
