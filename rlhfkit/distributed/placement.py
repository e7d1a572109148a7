"""Where the roles of an RL run go: placement groups, one bundle per device, and colocation by sharing bundles.

A *pool* is one Ray placement group with one bundle per device (a GPU and `cpus_per_bundle` CPUs; on a machine
without GPUs just `cpus_per_bundle` CPUs, so the same arithmetic runs in CPU tests). Every role (actor, critic,
reference, reward, vLLM engines) is a *member* of exactly one pool; rank r of a member sits on bundle r. When k
members share a pool (colocation) each of their ranks asks for 1/k of its bundle, so Ray admits them all on the
same device and the role processes take turns on it (sleep modes free memory between turns).

Which roles share a pool:
- `--colocate_all_models` (hybrid engine): everything shares the actor's pool; the vLLM engines need exactly
  one bundle per device of the actor (actor devices == engines x tensor parallel size).
- `--colocate_actor_ref`: actor and reference share; `--colocate_critic_reward`: critic and reward share.
- otherwise each role has a pool of its own.

`plan_pools` is pure arithmetic (tested without Ray); `ResourcePlan.create` makes the placement groups.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from rlhfkit.config.specs import PlacementSpec
from rlhfkit.distributed.ray_head import lean_local_head
from rlhfkit.errors import UserError


@dataclass(frozen=True)
class RoleDemand:
    """A role that needs devices: `ranks` processes, one device each (a vLLM engine needs `devices_per_rank`)."""

    name: str
    ranks: int
    devices_per_rank: int = 1

    @property
    def devices(self) -> int:
        return self.ranks * self.devices_per_rank


@dataclass
class Pool:
    """One placement group: `bundles` devices shared by `members` (names of roles)."""

    name: str
    bundles: int
    members: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Slot:
    """Where one Ray actor of a role goes and how much of its bundle it asks for."""

    pool: str
    bundle_index: int
    num_cpus: float
    num_gpus: float
    bundle_count: int = 1  # a tensor-parallel vLLM engine spans bundle_index .. bundle_index + bundle_count - 1
    threads: int = 1  # CPU threads of the actor (OMP_NUM_THREADS): the CPUs of its bundles (see plan_slots)


def plan_pools(demands: list[RoleDemand], *, colocate_all: bool, colocate_actor_ref: bool,
               colocate_critic_reward: bool) -> list[Pool]:
    """Group the roles into pools (placement groups) following the colocation flags.

    `demands` hold only the roles the run has, each with at least one rank: the config layer leaves out absent
    roles, gives a colocated role that was given 0 devices its host's rank count and checks that colocated roles
    fit (`rlhfkit.config.rl_resources`); a plan that breaks those rules here is a bug (ValueError)."""
    bad = [d.name for d in demands if d.ranks <= 0 or d.devices_per_rank <= 0]
    if bad:
        raise ValueError(f"roles without devices reached the placement: {bad}")
    by_name = {d.name: d for d in demands}
    pools: list[Pool] = []
    placed: set[str] = set()

    def share(pool_name: str, owner: str, guests: list[str], why: str) -> None:
        owner_devices = by_name[owner].devices
        pool = Pool(pool_name, owner_devices, [owner])
        for guest in guests:
            if guest not in by_name:
                continue
            if by_name[guest].devices > owner_devices:
                raise ValueError(f"{why}: {guest} needs {by_name[guest].devices} devices but the {owner} has "
                                 f"{owner_devices} (the config layer checks this)")
            pool.members.append(guest)
        placed.update(pool.members)
        pools.append(pool)

    if colocate_all:
        if "vllm" in by_name and by_name["vllm"].devices != by_name["actor"].devices:
            raise ValueError(f"--colocate_all_models: actor devices {by_name['actor'].devices} != vLLM devices "
                             f"{by_name['vllm'].devices} (the config layer checks this)")
        share("hybrid", "actor", ["ref", "critic", "reward", "teacher", "vllm", "hf_engine"],
              "--colocate_all_models")
    else:
        if colocate_actor_ref and ("ref" in by_name or "teacher" in by_name):  # the frozen models
            share("actor_ref", "actor", ["ref", "teacher"], "--colocate_actor_ref")
        if colocate_critic_reward and "critic" in by_name and "reward" in by_name:
            share("critic_reward", "critic", ["reward"], "--colocate_critic_reward")
    for name, demand in by_name.items():
        if name not in placed:
            pools.append(Pool(name, demand.devices, [name]))
            placed.add(name)
    return pools


def plan_slots(demands: list[RoleDemand], pools: list[Pool], *, use_gpu: bool,
               cpus_per_bundle: float) -> dict[str, list[Slot]]:
    """The slot of every rank of every role: rank r of a member takes bundle r (times its devices per rank)."""
    by_name = {d.name: d for d in demands}
    slots: dict[str, list[Slot]] = {}
    for pool in pools:
        fraction = 1.0 / len(pool.members)
        for member in pool.members:
            demand = by_name[member]
            per = demand.devices_per_rank
            # Members of a pool ask Ray for a fraction of the bundle, but colocated roles take turns (the engine
            # sleeps while the actor trains), so each runs as many threads as the bundle has CPUs: measured on a
            # 2-core machine, a GRPO step of the hybrid engine takes 1.18 s with 2 threads, 1.45-1.76 s with 1.
            threads = max(1, int(cpus_per_bundle * per))
            slots[member] = [Slot(pool.name, r * per, num_cpus=cpus_per_bundle * fraction,
                                  num_gpus=fraction if use_gpu else 0.0, bundle_count=per, threads=threads)
                             for r in range(demand.ranks)]
    return slots


def bundle(use_gpu: bool, cpus_per_bundle: float) -> dict[str, float]:
    return {"GPU": 1.0, "CPU": cpus_per_bundle} if use_gpu else {"CPU": cpus_per_bundle}


@dataclass
class ResourcePlan:
    """The placement groups of a run and the slot of every role's ranks."""

    pools: list[Pool]
    slots: dict[str, list[Slot]]
    use_gpu: bool
    cpus_per_bundle: float
    groups: dict[str, Any] = field(default_factory=dict)  # pool name -> ray PlacementGroup

    @classmethod
    def make(cls, demands: list[RoleDemand], *, colocate_all: bool = False, colocate_actor_ref: bool = False,
             colocate_critic_reward: bool = False, use_gpu: bool = False,
             cpus_per_bundle: float = 1.0) -> ResourcePlan:
        pools = plan_pools(demands, colocate_all=colocate_all, colocate_actor_ref=colocate_actor_ref,
                           colocate_critic_reward=colocate_critic_reward)
        slots = plan_slots(demands, pools, use_gpu=use_gpu, cpus_per_bundle=cpus_per_bundle)
        return cls(pools, slots, use_gpu, cpus_per_bundle)

    def total(self) -> dict[str, float]:
        """Resources all pools reserve together."""
        n = sum(p.bundles for p in self.pools)
        out = {"CPU": n * self.cpus_per_bundle}
        if self.use_gpu:
            out["GPU"] = float(n)
        return out

    def describe(self) -> str:
        parts = [f"{p.name}[{p.bundles} x {bundle(self.use_gpu, self.cpus_per_bundle)}: {'+'.join(p.members)}]"
                 for p in self.pools]
        return " ".join(parts)

    def create(self, timeout_s: float = 120.0) -> ResourcePlan:
        """Create every placement group and wait until Ray has reserved them (UserError if it cannot)."""
        import ray
        from ray.util.placement_group import placement_group

        available = ray.cluster_resources()
        for key, need in self.total().items():
            if available.get(key, 0.0) + 1e-9 < need:
                raise UserError(f"the Ray cluster has {available.get(key, 0.0):g} {key} but this run needs "
                                f"{need:g} ({self.describe()}); add nodes, lower the *_num_gpus_per_node flags "
                                "or colocate roles (--colocate_all_models)")
        for pool in self.pools:
            bundles = [bundle(self.use_gpu, self.cpus_per_bundle) for _ in range(pool.bundles)]
            self.groups[pool.name] = placement_group(bundles, strategy="PACK", name="")
        try:
            ray.get([pg.ready() for pg in self.groups.values()], timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            self.remove()
            raise UserError(f"Ray could not reserve the placement groups within {timeout_s:g} s "
                            f"({self.describe()}); is the cluster busy?") from None
        return self

    def scheduling(self, slot: Slot) -> Any:
        """The Ray scheduling strategy that pins an actor to its bundle."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return PlacementGroupSchedulingStrategy(placement_group=self.groups[slot.pool],
                                                placement_group_bundle_index=slot.bundle_index,
                                                placement_group_capture_child_tasks=True)

    def remove(self) -> None:
        from ray.util.placement_group import remove_placement_group

        for pg in self.groups.values():
            try:
                remove_placement_group(pg)
            except Exception:  # noqa: BLE001 - best effort on shutdown
                pass
        self.groups.clear()


def connect_ray(min_cpus: float) -> bool:
    """Join the cluster named by RAY_ADDRESS, or start a local one; True when this call started Ray."""
    import logging
    import math
    import os

    import ray

    if ray.is_initialized():
        return False
    for key, value in {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}.items():
        os.environ.setdefault(key, value)
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address="auto", logging_level=logging.ERROR)
    else:  # a new local cluster (never a stale `ray start` address); logical CPUs: roles mostly take turns, so
        # a small machine may host more bundles than cores. No autoscaler monitor or dashboard: ray_head.py
        with lean_local_head():
            ray.init(address="local", num_cpus=max(os.cpu_count() or 1, math.ceil(min_cpus)),
                     include_dashboard=False, logging_level=logging.ERROR)
    return True


def unwrap_user_error(e: BaseException) -> BaseException:
    """The UserError an actor raised (Ray wraps it in a RayTaskError), or `e` itself."""
    cause = getattr(e, "cause", None)
    return UserError(str(cause)) if isinstance(cause, UserError) else e


def role_demands(spec: PlacementSpec) -> list[RoleDemand]:
    """The devices each role of a Ray run needs, engines last (vLLM: engines x tensor parallel; the Transformers
    engine: one)."""
    demands = [RoleDemand(role, ranks) for role, ranks in spec.role_ranks]
    return demands + [RoleDemand(spec.engine_role, spec.engine_ranks, spec.engine_devices_per_rank)]


#: CPUs per placement bundle, overriding `bundle_cpus`'s choice (benchmarks, clusters whose nodes differ).
CPUS_PER_BUNDLE_ENV = "RLHFKIT_RAY_CPUS_PER_BUNDLE"


def bundle_cpus(bundles: int, use_gpu: bool) -> float:
    """CPUs each placement bundle reserves (and threads each role rank runs) when the user did not say
    (`RLHFKIT_RAY_CPUS_PER_BUNDLE`, which wins). With GPUs, or on a running cluster (RAY_ADDRESS, or Ray already
    started in this process) whose nodes this driver cannot see: 1. On a local CPU cluster: the machine's cores
    spread over the run's bundles, at least 1, at most OMP_NUM_THREADS when it is set (the threads the user gave
    each process). Roles that share a bundle (--colocate_all_models: the actor trains while the engine sleeps) take
    turns and each get all of its CPUs; roles on bundles of their own run at once and split the cores. Measured on
    2 cores: a tiny hybrid-engine GRPO step 1.18 s on one 2-CPU bundle, 1.45-1.76 s on a 1-CPU bundle."""
    import sys

    if os.environ.get(CPUS_PER_BUNDLE_ENV):
        return float(os.environ[CPUS_PER_BUNDLE_ENV])
    ray = sys.modules.get("ray")  # not imported here: checks run before Ray and must stay cheap
    joined = bool(os.environ.get("RAY_ADDRESS")) or (ray is not None and ray.is_initialized())
    if use_gpu or joined:
        return 1.0
    cores = max(1, (os.cpu_count() or 1) // max(1, bundles))
    threads = os.environ.get("OMP_NUM_THREADS", "")
    return float(min(cores, int(threads)) if threads.isdigit() and int(threads) > 0 else cores)


def plan_for(spec: PlacementSpec, *, use_gpu: bool, cpus_per_bundle: float) -> ResourcePlan:
    """The placement of a run's roles and engines (no placement group is made yet: `ResourcePlan.create`)."""
    return ResourcePlan.make(role_demands(spec), colocate_all=spec.colocate_all,
                             colocate_actor_ref=spec.colocate_actor_ref,
                             colocate_critic_reward=spec.colocate_critic_reward, use_gpu=use_gpu,
                             cpus_per_bundle=cpus_per_bundle)
