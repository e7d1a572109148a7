"""`run_ppo_ray(cfg)`: the RL run with every role a Ray actor group and the rollout engines Ray actors.

Same trainer (`rlhfkit.rl.trainer.RLTrainer`) and loop (`rlhfkit.rl.loop`) as `train_ppo`; only the parts handed
in differ: the role handles are `RayActorGroup`s wrapping the local roles of `roles.py` (one object per rank, their
own torch.distributed world each) and a `RolloutEngineGroup` over vLLM engines (`--vllm_num_engines N`) or one
Transformers engine actor (`0`, `rollout/hf_engine_actor.py`; with --colocate_all_models and one actor rank the
engine runs inside the actor's process on its module instead, `actor_engine.py`); the weight sync
(`weight_sync.RayWeightSync`) streams weights from the actor's rank 0 straight to the engines instead of passing
them through the driver; with
--async_train the batch supply is the generator actor's queue and weight syncs take its lock (`async_driver`).

Everything a user can get wrong is checked before Ray starts (`prepare_ray_run`): the RL config, the placement
arithmetic (colocation, hybrid engine), the engine settings, the model paths, the prompts and the reward source.
Ray: a running cluster when RAY_ADDRESS is set (`ray job submit` sets it), else a local one started here.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from rlhfkit.config.lora_sync import lora_sync_mode
from rlhfkit.config.rl import PPOConfig
from rlhfkit.config.rl_specs import rl_specs
from rlhfkit.config.shared_engine import run_shares_actor_weights
from rlhfkit.config.specs import PlacementSpec, RLSpecs
from rlhfkit.config.vision import vision_engine_note
from rlhfkit.distributed.determinism import enable_full_determinism, gpu_limits_note
from rlhfkit.distributed.placement import ResourcePlan, bundle_cpus, connect_ray, plan_for, unwrap_user_error
from rlhfkit.distributed.startup_clock import StartupClock, actor_marks
from rlhfkit.errors import UserError
from rlhfkit.rl.actor_engine import ActorEngine
from rlhfkit.rl.loop import RoleHandles, rl_settings
from rlhfkit.rl.rollout_source import RolloutSource
from rlhfkit.rl.trainer import BatchSupply, RLTrainer
from rlhfkit.rl.weight_sync import RayWeightSync, WeightSync
from rlhfkit.rollout.factory import check_engines
from rlhfkit.run.loop import TrainingLoop


def local_gpus() -> bool:
    return torch.cuda.is_available()


def sync_backend(placement: PlacementSpec, use_gpu: bool) -> str:
    """nccl needs GPUs on both sides; without them weights go through the object store (gloo broadcast on ask)."""
    backend = placement.sync_backend
    if backend == "nccl" and not use_gpu:
        return "object"
    return backend


@dataclass
class RayRunPlan:
    """Everything decided before Ray starts."""

    plan: ResourcePlan
    use_gpu: bool
    sync_backend: str
    specs: RLSpecs  # what each role and the engines are built from
    inputs: Any = None  # setup.RLInputs: tokenizer, prompts, text reward source, optimizer-step count
    notes: list[str] = field(default_factory=list)
    http_teacher: Any = None  # teacher.HTTPTeacher of --teacher_url (a local teacher is a role group)
    shared_engine: bool = False  # the Transformers engine runs in the actor's process on its module (actor_engine)


def check_ray_config(cfg: PPOConfig, use_gpu: bool | None = None,
                     cpus_per_bundle: float | None = None) -> RayRunPlan:
    """What needs the machine or the inputs, before any data and Ray (every flag rule, placement arithmetic
    included, ran when the config was parsed): the inputs, what the engines need (vLLM installed, GPUs for tensor
    parallelism), the bundles of this machine (`cpus_per_bundle` CPUs each; None: `placement.bundle_cpus`), the
    model paths. Derives the run's specs. UserError."""
    from rlhfkit.models.loading import check_model_path
    from rlhfkit.models.moe import check_aux_loss_coef

    cfg.check_inputs()  # the flags were validated when parsed
    use_gpu = local_gpus() if use_gpu is None else use_gpu
    specs = rl_specs(cfg)
    # A job on a running cluster may be driven from a node without GPUs: its GPUs are only known once connected.
    check_engines(specs.engine, use_gpu or bool(os.environ.get("RAY_ADDRESS")))
    plan = plan_for(specs.placement, use_gpu=use_gpu, cpus_per_bundle=cpus_per_bundle or 1.0)
    if cpus_per_bundle is None:
        plan = plan_for(specs.placement, use_gpu=use_gpu,
                        cpus_per_bundle=bundle_cpus(sum(p.bundles for p in plan.pools), use_gpu))
    if specs.actor.model.lora_rank > 0 and "actor" in specs.placement.offload_between_calls and use_gpu:
        raise UserError("--deepspeed_enable_sleep with --lora_rank is not supported; drop one of them")
    check_model_path(specs.actor.model.pretrain)
    check_aux_loss_coef(specs.actor.aux_loss_coef, specs.actor.model.pretrain)
    if specs.reward is not None:
        check_model_path(specs.reward.path, "--reward_pretrain")
    if specs.critic is not None and cfg.rl_model.critic_pretrain:
        check_model_path(specs.critic.path, "--critic_pretrain")
    run = RayRunPlan(plan, use_gpu, sync_backend(specs.placement, use_gpu), specs)
    run.shared_engine = run_shares_actor_weights(cfg, specs)  # the rule the --dry_run planner plans with
    if run.shared_engine:
        run.notes.append("the Transformers engine generates in the actor's process on the actor's own weights "
                         "(no engine process, no weight copy to sync)")
    if run.sync_backend != specs.placement.sync_backend:
        run.notes.append(f"--vllm_sync_backend {specs.placement.sync_backend} needs GPUs; weights go through the "
                         "Ray object store instead")
    _, lora_note = lora_sync_mode(cfg.rollout.lora_sync, cfg.model.lora_rank, specs.engine.backend)
    if lora_note:
        run.notes.append(lora_note)
    vision_note = vision_engine_note(cfg)
    if vision_note:
        run.notes.append(vision_note)
    elif specs.engine.enable_sleep and not use_gpu:
        run.notes.append("--vllm_enable_sleep: vLLM has no sleep mode on CPU; engines only drop their prefix cache")
    return run


def prepare_ray_run(cfg: PPOConfig, use_gpu: bool | None = None,
                    cpus_per_bundle: float | None = None) -> RayRunPlan:
    """`check_ray_config` plus the tokenizer, the prompts and the text reward source (still no Ray)."""
    from rlhfkit.rl.teacher import check_distillation, http_teacher
    from rlhfkit.run.setup import load_rl_inputs

    run = check_ray_config(cfg, use_gpu, cpus_per_bundle)
    if cfg.strategy.full_determinism:  # this driver, and through its environment every worker and engine it starts
        enable_full_determinism()
        if run.use_gpu:
            run.notes.append(gpu_limits_note())
    run.inputs = load_rl_inputs(cfg, tokenizer_apart=True)  # the driver loads no model: it never imports its stack
    check_distillation(cfg, run.inputs.tokenizer)  # before Ray starts
    run.http_teacher = http_teacher(cfg)
    return run


# -- pieces of the Ray run ----------------------------------------------------------------------------------------
class DriverStrategy:
    """What the loop and the checkpoint code need from a strategy, in the driver (a world of one, no group)."""

    rank, world_size, is_rank0 = 0, 1, True

    def barrier(self) -> None:
        """Role groups synchronise inside their own calls; the driver has nobody to wait for."""

    def print(self, *args: Any) -> None:
        print(*args, flush=True)


@dataclass
class RayRoles:
    """The Ray objects of a run, so they can be torn down whatever happens."""

    plan: ResourcePlan
    groups: dict[str, Any] = field(default_factory=dict)
    engine: Any = None

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
        for group in self.groups.values():
            group.kill()
        self.plan.remove()


def build_ray_roles(run: RayRunPlan, clock: StartupClock | None = None) -> tuple[Any, RayRoles]:
    """Placement groups, role groups and engines, each built from its spec; returns (RoleHandles, RayRoles). The
    `clock` gets the placement and the roles-and-engines phases and each role's and engine's own milestones."""
    from rlhfkit.agents.episodes import run_episodes
    from rlhfkit.distributed.launch import DIST_TIMEOUT_ENV
    from rlhfkit.distributed.ray_groups import RayActorGroup
    from rlhfkit.rl.loop import RoleHandles
    from rlhfkit.rl.roles import ActorRole, CriticRole, ReferenceRole, RewardModelRole
    from rlhfkit.rl.teacher import TeacherRole
    from rlhfkit.rollout.factory import engine_group

    plan, specs = run.plan, run.specs
    clock = clock or StartupClock()
    ray_roles = RayRoles(plan.create())
    clock.lap("placement")
    try:
        steps = run.inputs.num_update_steps
        roles = {"actor": (ActorRole, (specs.actor, steps)), "critic": (CriticRole, (specs.critic, steps)),
                 "ref": (ReferenceRole, (specs.ref,)), "reward": (RewardModelRole, (specs.reward,)),
                 "teacher": (TeacherRole, (specs.teacher,))}
        timeout_env = {DIST_TIMEOUT_ENV: str(specs.placement.ddp_timeout)}  # role groups and the weight-sync group
        # Engines first: they take longest to come up (vLLM's import alone is most of it), and a role group's
        # constructor waits for its rank 0 process to answer (the rendezvous address) before it returns.
        if not run.shared_engine:
            clock.launched("engine")
            ray_roles.engine = engine_group(specs.engine, plan, use_gpu=run.use_gpu, sync_backend=run.sync_backend,
                                            env=timeout_env, wait=False, episode_runner=run_episodes)
        for name, (cls, args) in roles.items():
            if name in plan.slots:
                clock.launched(name)
                ray_roles.groups[name] = RayActorGroup(
                    name, cls, plan, plan.slots[name], init_args=args, env=timeout_env, wait=False,
                    offload_between_calls=name in specs.placement.offload_between_calls,
                    sp_size=specs.actor.strategy.ring_attn_size)  # one --ring_attn_size for every role
        for group in ray_roles.groups.values():  # every role and engine started above loads in parallel
            group.ready()
        if run.shared_engine:
            ray_roles.engine = ActorEngine(ray_roles.groups["actor"], specs.engine, run_episodes)
        ray_roles.engine.info()
        clock.lap("roles_and_engines")
        for name, group in ray_roles.groups.items():  # rank 0 of each role, engine 0
            clock.add_actor_marks(name, actor_marks(group.workers[:1])[0])
        if ray_roles.engine.engines:  # none when the engine lives in the actor
            clock.add_actor_marks("engine", actor_marks(ray_roles.engine.engines[:1])[0])
    except BaseException:
        ray_roles.shutdown()
        raise
    groups = ray_roles.groups
    handles = RoleHandles(actor=groups["actor"], engine=ray_roles.engine,
                          reward=groups.get("reward", run.inputs.text_reward), ref=groups.get("ref"),
                          critic=groups.get("critic"), teacher=groups.get("teacher", run.http_teacher))
    return handles, ray_roles


def record_placement(ray_roles: RayRoles, save_path: str) -> str | None:
    """When the run spans more than one Ray node: which node each role's ranks and each engine run on, written to
    `save_path`/placement.json ({"roles": {role: [node id per rank]}, "nodes": {node id: IP}}) and returned as a
    line to print. None on one node (one machine needs no map)."""
    import json
    from pathlib import Path

    from rlhfkit.distributed.ray_groups import actor_nodes

    members = {name: group.workers for name, group in ray_roles.groups.items()}
    members["engine"] = list(ray_roles.engine.engines)
    roles: dict[str, list[str]] = {}
    ips: dict[str, str] = {}
    for name, actors in members.items():
        where = actor_nodes(actors, f"the {name} role")
        roles[name] = [node for node, _ in where]
        ips.update(where)
    if len(ips) < 2:
        return None
    out = Path(save_path)
    out.mkdir(parents=True, exist_ok=True)
    (out / "placement.json").write_text(json.dumps({"roles": roles, "nodes": ips}, indent=1))
    short = {node: f"{ips[node]}/{node[:8]}" for node in ips}
    return f"{len(ips)} nodes: " + "; ".join(f"{name} on {', '.join(short[n] for n in nodes)}"
                                             for name, nodes in roles.items())


def run_ppo_ray(cfg: PPOConfig, *, cpus_per_bundle: float | None = None,
                after_sync: list[Callable[[RLTrainer], None]] | None = None, save: bool = True) -> RLTrainer:
    """Validate, start (or join) Ray, build the role groups and engines, run the RL loop, save, tear down. Returns
    the trainer; `after_sync` callbacks get it after every weight sync (tests, benchmarks)."""
    from rlhfkit.run.setup import prepare_rl_run, train_rl

    clock = StartupClock()
    run = prepare_ray_run(cfg, cpus_per_bundle=cpus_per_bundle)
    run_info = prepare_rl_run(cfg, "ppo_ray")

    from rlhfkit.distributed.ray_groups import set_call_timeout

    set_call_timeout(cfg.resources.ray_call_timeout)  # every Ray call of this run: a dead or stuck part stops it
    strategy = DriverStrategy()
    for note in run.notes:
        strategy.print(f"train_ppo_ray: {note}")
    clock.lap("checks_and_inputs")
    started_ray = connect_ray(run.plan.total()["CPU"])
    clock.lap("ray_init")
    ray_roles = None
    try:
        import ray

        cluster_gpus = ray.cluster_resources().get("GPU", 0) > 0
        if cluster_gpus != run.use_gpu:  # e.g. a driver without GPUs on a GPU cluster: bundles follow the cluster
            replanned = check_ray_config(cfg, cluster_gpus, cpus_per_bundle)
            run.plan, run.use_gpu, run.sync_backend = replanned.plan, cluster_gpus, replanned.sync_backend

        started = time.perf_counter()
        try:
            roles, ray_roles = build_ray_roles(run, clock)
        except ray.exceptions.RayTaskError as e:
            raise unwrap_user_error(e) from None
        rank = run.specs.engine.lora_rank  # > 0: adapter-only sync, through the object store whatever the backend
        how = f"LoRA adapter only (rank {rank}, object store)" if rank else run.sync_backend
        how = "none (the engine reads the actor's weights)" if run.shared_engine else how
        strategy.print(f"train_ppo_ray: placement {run.plan.describe()}; roles and engines up in "
                       f"{time.perf_counter() - started:.1f} s; weight sync: {how}")
        spread = record_placement(ray_roles, cfg.checkpoint.save_path)
        if spread:
            strategy.print(f"train_ppo_ray: {spread}")
        assemble = ray_loop_assembly(cfg, roles, ray_roles.groups.get("reward"), run.inputs, strategy, run_info,
                                     after_sync or [], clock)
        return train_rl(cfg, strategy, "ppo_ray", assemble, save=save)
    finally:
        if ray_roles is not None:
            ray_roles.shutdown()
        run.inputs.close()
        if started_ray:
            import ray

            ray.shutdown()


def _startup_done(clock: StartupClock, ray_sync: RayWeightSync, logger: Any, strategy: Any) -> None:
    """After the first weight sync (the last of start-up): log and print the start-up phases, once."""
    if len(ray_sync.seconds) != 1:
        return
    clock.lap("assembly_and_first_sync")
    clock.phases["first_sync_s"] = ray_sync.seconds[0]
    logger.log(0, clock.metrics(), prefix="startup")
    strategy.print(f"train_ppo_ray: {clock.line()}")


def ray_loop_assembly(cfg: PPOConfig, roles: RoleHandles, reward_group: Any, inputs: Any, strategy: Any,
                      run_info: Any, after_sync: list[Callable[[RLTrainer], None]],
                      clock: StartupClock | None = None) -> Callable[[Any], TrainingLoop]:
    """How the Ray run's trainer is put together over its roles, given the metrics logger: the driver's rollout
    source over the engine group; weights streamed by `RayWeightSync`; synchronous, the source is the batch
    supply; with --async_train the generator actor's queue is, and weight syncs take the generator's lock. The
    start-up `clock`'s phases, the first weight sync last, go to the metrics at step 0 (`startup/<phase>_s`)."""

    def assemble(logger: Any) -> TrainingLoop:
        source = RolloutSource(cfg, roles.engine, roles.reward, inputs.tokenizer, inputs.prompts)
        ray_sync = RayWeightSync(roles.actor, roles.engine, adapter=rl_specs(cfg).engine.lora_rank > 0)
        supply: BatchSupply = source
        weight_sync: WeightSync = ray_sync
        if cfg.asynchronous.async_train:  # generation in its own actor, overlapping training
            from rlhfkit.rl.async_driver import GeneratorQueue, LockedWeightSync

            supply = GeneratorQueue(cfg, inputs.prompts, roles.engine, reward_group,
                                    has_reference=roles.ref is not None)
            weight_sync = LockedWeightSync(ray_sync, supply)
        trainer = RLTrainer(cfg, roles.actor, supply, weight_sync, source, logger, strategy, ref=roles.ref,
                            critic=roles.critic, eval_prompts=inputs.eval_prompts, teacher=roles.teacher)
        if clock is not None:
            ray_sync.after_sync.append(functools.partial(_startup_done, clock, ray_sync, logger, strategy))
        ray_sync.after_sync.extend(functools.partial(callback, trainer) for callback in after_sync)
        return TrainingLoop(trainer, rl_settings(cfg), strategy, logger, run_info)

    return assemble
