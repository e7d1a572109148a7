"""`run_ppo_ray(cfg)`: the RL run with every role a Ray actor group and the rollout engines Ray actors.

Same loop as `train_ppo` (`rl_loop.RLTrainer`); only the role handles differ: `RayActorGroup`s wrapping the
local roles of `roles.py` (one object per rank, their own torch.distributed world each) and a
`RolloutEngineGroup` over vLLM engines (`--vllm_num_engines N`) or one Transformers engine actor (`0`,
`rollout/hf_engine_actor.py`). The only method the Ray run replaces is `sync_weights`: weights stream from the
actor's rank 0 straight to the engines (`RolloutEngineGroup.sync_from`) instead of passing through the driver as
one state dict.

Everything a user can get wrong is checked before Ray starts (`prepare_ray_run`): the RL config, the placement
arithmetic (colocation, hybrid engine), the engine settings, the model paths, the prompts and the reward source.
Ray: a running cluster when RAY_ADDRESS is set (`ray job submit` sets it), else a local one started here.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from rlhfkit.config.common import check_batch_split
from rlhfkit.config.rl import (
    PPOConfig,
    needs_critic,
    samples_per_rollout,
)
from rlhfkit.distributed.placement import ResourcePlan, connect_ray, role_demands, unwrap_user_error
from rlhfkit.errors import UserError
from rlhfkit.rl.loop import RLTrainer
from rlhfkit.rollout.vllm_engine import check_vllm_args


def local_gpus() -> bool:
    return torch.cuda.is_available()


def sync_backend(cfg: PPOConfig, use_gpu: bool) -> str:
    """nccl needs GPUs on both sides; without them weights go through the object store (gloo broadcast on ask)."""
    backend = cfg.rollout.vllm_sync_backend
    if backend == "nccl" and not use_gpu:
        return "object"
    return backend


@dataclass
class RayRunPlan:
    """Everything decided before Ray starts."""

    plan: ResourcePlan
    use_gpu: bool
    sync_backend: str
    inputs: Any = None  # setup.RLInputs: tokenizer, prompts, text reward source, optimizer-step count
    notes: list[str] = field(default_factory=list)


def check_ray_config(cfg: PPOConfig, use_gpu: bool | None = None, cpus_per_bundle: float = 1.0) -> RayRunPlan:
    """Checks that need no data and no Ray (the flags were validated when parsed): inputs, placement, engines,
    each role's batch split. UserError."""
    from rlhfkit.models.loading import check_model_path
    from rlhfkit.models.moe import check_aux_loss_coef

    cfg.check_inputs()  # the flags were validated when parsed
    use_gpu = local_gpus() if use_gpu is None else use_gpu
    r, res = cfg.rollout, cfg.resources
    # A job on a running cluster may be driven from a node without GPUs: its GPUs are only known once connected.
    check_vllm_args(r.vllm_num_engines, r.vllm_tensor_parallel_size, use_gpu or bool(os.environ.get("RAY_ADDRESS")))
    demands = role_demands(cfg)
    plan = ResourcePlan.make(demands, colocate_all=res.colocate_all_models, colocate_actor_ref=res.colocate_actor_ref,
                             colocate_critic_reward=res.colocate_critic_reward, use_gpu=use_gpu,
                             cpus_per_bundle=cpus_per_bundle)
    samples = samples_per_rollout(cfg)
    s = cfg.strategy
    for d in demands:
        if d.name in ("vllm", "hf_engine"):
            continue
        flags = f"--{d.name}_num_nodes x --{d.name}_num_gpus_per_node"
        if samples % d.ranks:
            raise UserError(f"{samples} samples per step (--rollout_batch_size x --n_samples_per_prompt) do not "
                            f"split evenly over the {d.ranks} {d.name} ranks ({flags}); use a multiple of {d.ranks}")
        # every role's DeepSpeed config splits the train batch over its own ranks
        check_batch_split(s.train_batch_size, s.micro_train_batch_size, d.ranks, f"{d.name} ranks ({flags})")
    if cfg.model.lora_rank > 0 and cfg.resources.deepspeed_enable_sleep and use_gpu:
        raise UserError("--deepspeed_enable_sleep with --lora_rank is not supported; drop one of them")
    check_model_path(cfg.model.pretrain)
    check_aux_loss_coef(cfg.algo.aux_loss_coef, cfg.model.pretrain)
    if cfg.rl_model.reward_pretrain:
        check_model_path(cfg.rl_model.reward_pretrain, "--reward_pretrain")
    if needs_critic(cfg) and cfg.rl_model.critic_pretrain:
        check_model_path(cfg.rl_model.critic_pretrain, "--critic_pretrain")
    run = RayRunPlan(plan, use_gpu, sync_backend(cfg, use_gpu))
    if run.sync_backend != r.vllm_sync_backend:
        run.notes.append(f"--vllm_sync_backend {r.vllm_sync_backend} needs GPUs; weights go through the Ray "
                         "object store instead")
    if r.vllm_enable_sleep and not use_gpu:
        run.notes.append("--vllm_enable_sleep: vLLM has no sleep mode on CPU; engines only drop their prefix cache")
    return run


def prepare_ray_run(cfg: PPOConfig, use_gpu: bool | None = None, cpus_per_bundle: float = 1.0) -> RayRunPlan:
    """`check_ray_config` plus the tokenizer, the prompts and the text reward source (still no Ray)."""
    from rlhfkit.run.setup import load_rl_inputs

    run = check_ray_config(cfg, use_gpu, cpus_per_bundle)
    run.inputs = load_rl_inputs(cfg)
    return run


# -- pieces of the Ray run ----------------------------------------------------------------------------------------
class DriverStrategy:
    """What the loop and the checkpoint code need from a strategy, in the driver (a world of one, no group)."""

    rank, world_size, is_rank0 = 0, 1, True

    def barrier(self) -> None:
        """Role groups synchronise inside their own calls; the driver has nobody to wait for."""

    def print(self, *args: Any) -> None:
        print(*args, flush=True)


class RayRLTrainer(RLTrainer):
    """`RLTrainer` unchanged but for the weight sync path; `after_sync` callbacks run after every sync."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.after_sync: list[Any] = []
        self.sync_seconds: list[float] = []

    def sync_weights(self) -> None:
        started = time.perf_counter()
        self.roles.engine.sync_from(self.roles.actor)
        self.sync_seconds.append(time.perf_counter() - started)
        for callback in self.after_sync:
            callback(self)


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


def build_ray_roles(cfg: PPOConfig, run: RayRunPlan) -> tuple[Any, RayRoles]:
    """Placement groups, role groups and engines; returns (RoleHandles, RayRoles)."""
    from rlhfkit.distributed.launch import DIST_TIMEOUT_ENV
    from rlhfkit.distributed.ray_groups import RayActorGroup
    from rlhfkit.rl.loop import RoleHandles
    from rlhfkit.rl.roles import ActorRole, CriticRole, ReferenceRole, RewardModelRole
    from rlhfkit.rollout.hf_engine_actor import HFEngineActor
    from rlhfkit.rollout.vllm_engine import (
        RolloutEngineGroup,
        VLLMEngineArgs,
        create_engine_actors,
        create_vllm_engines,
    )

    plan, res, r = run.plan, cfg.resources, cfg.rollout
    ray_roles = RayRoles(plan.create())
    try:
        slots = plan.slots
        sleep, offload = res.deepspeed_enable_sleep, res.ref_reward_offload
        steps = run.inputs.num_update_steps
        specs = {"actor": (ActorRole, (cfg, steps), sleep), "critic": (CriticRole, (cfg, steps), sleep),
                 "ref": (ReferenceRole, (cfg,), offload), "reward": (RewardModelRole, (cfg,), offload)}
        timeout_env = {DIST_TIMEOUT_ENV: str(cfg.strategy.ddp_timeout)}  # role groups and the weight-sync group
        for name, (cls, args, between_calls) in specs.items():
            if name in slots:
                ray_roles.groups[name] = RayActorGroup(name, cls, plan, slots[name], init_args=args,
                                                       offload_between_calls=between_calls, env=timeout_env,
                                                       wait=False)
        if "vllm" in slots:
            from transformers import AutoConfig

            limit = getattr(AutoConfig.from_pretrained(cfg.model.pretrain), "max_position_embeddings", None) or 10**9
            base = VLLMEngineArgs(
                model=cfg.model.pretrain, tensor_parallel_size=r.vllm_tensor_parallel_size,
                gpu_memory_utilization=r.vllm_gpu_memory_utilization, enforce_eager=r.enforce_eager or not run.use_gpu,
                enable_prefix_caching=r.enable_prefix_caching, dtype="bfloat16" if cfg.model.bf16 else "float32",
                seed=cfg.strategy.seed, enable_sleep=r.vllm_enable_sleep,
                max_model_len=min(cfg.data.prompt_max_len + cfg.data.generate_max_len + 1, limit))
            actors = create_vllm_engines(plan, slots["vllm"], base, env=timeout_env, wait=False)
        else:
            actors = create_engine_actors(HFEngineActor, plan, slots["hf_engine"], lambda i: cfg, env=timeout_env,
                                          wait=False)
        ray_roles.engine = RolloutEngineGroup(actors, sync_backend=run.sync_backend)
        for group in ray_roles.groups.values():  # every role and engine started above loads in parallel
            group.ready()
        ray_roles.engine.info()
    except BaseException:
        ray_roles.shutdown()
        raise
    groups = ray_roles.groups
    handles = RoleHandles(actor=groups["actor"], engine=ray_roles.engine,
                          reward=groups.get("reward", run.inputs.text_reward), ref=groups.get("ref"),
                          critic=groups.get("critic"))
    return handles, ray_roles


def run_ppo_ray(cfg: PPOConfig, *, cpus_per_bundle: float | None = None, after_sync: list[Any] | None = None,
                save: bool = True) -> RayRLTrainer:
    """Validate, start (or join) Ray, build the role groups and engines, run the RL loop, save, tear down."""
    from rlhfkit.run.setup import prepare_rl_run, train_rl

    cpus = cpus_per_bundle or float(os.environ.get("RLHFKIT_RAY_CPUS_PER_BUNDLE", "1"))
    run = prepare_ray_run(cfg, cpus_per_bundle=cpus)
    run_info = prepare_rl_run(cfg, "ppo_ray")

    from rlhfkit.distributed.ray_groups import set_call_timeout

    set_call_timeout(cfg.resources.ray_call_timeout)  # every Ray call of this run: a dead or stuck part stops it
    strategy = DriverStrategy()
    for note in run.notes:
        strategy.print(f"train_ppo_ray: {note}")
    started_ray = connect_ray(run.plan.total()["CPU"])
    ray_roles = None
    try:
        import ray

        cluster_gpus = ray.cluster_resources().get("GPU", 0) > 0
        if cluster_gpus != run.use_gpu:  # e.g. a driver without GPUs on a GPU cluster: bundles follow the cluster
            replanned = check_ray_config(cfg, cluster_gpus, cpus)
            run.plan, run.use_gpu, run.sync_backend = replanned.plan, cluster_gpus, replanned.sync_backend

        started = time.perf_counter()
        try:
            roles, ray_roles = build_ray_roles(cfg, run)
        except ray.exceptions.RayTaskError as e:
            raise unwrap_user_error(e) from None
        strategy.print(f"train_ppo_ray: placement {run.plan.describe()}; roles and engines up in "
                       f"{time.perf_counter() - started:.1f} s; weight sync: {run.sync_backend}")
        trainer_cls, extra = RayRLTrainer, {}
        if cfg.asynchronous.async_train:  # generation in its own actor, overlapping training
            from rlhfkit.rl.async_driver import with_async_training

            trainer_cls, extra = with_async_training(RayRLTrainer), {"reward_handle": ray_roles.groups.get("reward")}
        return train_rl(trainer_cls, cfg, roles, run.inputs, strategy, run_info, "ppo_ray", save=save,
                        before_fit=lambda trainer: trainer.after_sync.extend(after_sync or []), **extra)
    finally:
        if ray_roles is not None:
            ray_roles.shutdown()
        run.inputs.close()
        if started_ray:
            import ray

            ray.shutdown()
