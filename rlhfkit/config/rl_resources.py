"""The RL config's rules and derived settings about roles and devices: which roles a run has, how many ranks each
gets (colocation included), and the flag rules of the placement (device counts, colocation, each role's batch
split), all checked at parse time by `PPOConfig.validate`. What needs the machine (GPUs, the Ray cluster) is
checked when the run starts (`rlhfkit.rl.ray_run.check_ray_config`)."""

from __future__ import annotations

from typing import Protocol

from rlhfkit.config.common import StrategyArgs, check_batch_split
from rlhfkit.config.distill import DistillArgs
from rlhfkit.config.rl_sections import AlgorithmArgs, ResourceArgs, RLModelArgs, RolloutArgs
from rlhfkit.errors import UserError


class RLFlags(Protocol):
    """The sections of `rlhfkit.config.rl.PPOConfig` these rules read (a Protocol, so that `config.rl`, which runs
    the rules, is not imported back here). Read-only, so a config may hold a subclass of a section (PPOConfig's
    RLStrategyArgs, which only changes defaults)."""

    @property
    def algo(self) -> AlgorithmArgs: ...
    @property
    def rl_model(self) -> RLModelArgs: ...
    @property
    def resources(self) -> ResourceArgs: ...
    @property
    def rollout(self) -> RolloutArgs: ...
    @property
    def strategy(self) -> StrategyArgs: ...
    @property
    def distill(self) -> DistillArgs: ...


def check_positive(values: dict[str, float]) -> None:
    for flag, value in values.items():
        if value is None or value <= 0:
            raise UserError(f"--{flag} must be positive (got {value})")


def needs_reference(cfg: RLFlags) -> bool:
    """A reference model is needed for a KL penalty or a KL loss."""
    return cfg.algo.init_kl_coef > 0 or cfg.algo.use_kl_loss


def needs_critic(cfg: RLFlags) -> bool:
    return cfg.algo.advantage_estimator == "gae"


ROLES = ("actor", "critic", "ref", "reward", "teacher")
FROZEN_ON_ACTOR = ("ref", "teacher")  # the frozen models --colocate_actor_ref puts on the actor's devices


def role_needed(cfg: RLFlags, role: str) -> bool:
    """Whether this run has the role: no critic for a group estimator, no reward model with --remote_rm_url, no
    reference without KL, a teacher role only for a local distillation teacher (--teacher_pretrain)."""
    return {"actor": True, "critic": needs_critic(cfg), "ref": needs_reference(cfg),
            "reward": bool(cfg.rl_model.reward_pretrain), "teacher": bool(cfg.distill.teacher_pretrain)}[role]


def _colocated_host(cfg: RLFlags, role: str) -> str | None:
    """The role whose devices `role` shares (actor for the hybrid engine and --colocate_actor_ref; critic for
    --colocate_critic_reward), or None."""
    res = cfg.resources
    if role == "actor":
        return None
    if res.colocate_all_models or (role in FROZEN_ON_ACTOR and res.colocate_actor_ref):
        return "actor"
    if role == "reward" and res.colocate_critic_reward and role_needed(cfg, "critic"):
        return "critic"
    return None


def role_ranks(cfg: RLFlags, role: str) -> int:
    """Processes (one device each) of a role: --{role}_num_nodes x --{role}_num_gpus_per_node.

    OpenRLHF's hybrid-engine commands give colocated roles 0 nodes / 0 GPUs ("they live on the actor's devices"):
    a colocated role with 0 devices gets as many ranks as the role it is colocated with."""
    res = cfg.resources
    ranks = getattr(res, f"{role}_num_nodes") * getattr(res, f"{role}_num_gpus_per_node")
    host = _colocated_host(cfg, role)
    if ranks == 0 and host is not None:
        return role_ranks(cfg, host)
    return ranks


def validate_resources(cfg: RLFlags) -> None:
    res, r = cfg.resources, cfg.rollout
    if not res.ray_call_timeout > 0:
        raise UserError(f"--ray_call_timeout must be a positive number of seconds (got {res.ray_call_timeout})")
    check_positive({"actor_num_nodes": res.actor_num_nodes, "actor_num_gpus_per_node": res.actor_num_gpus_per_node})
    for role in ROLES[1:]:
        nodes, gpus = getattr(res, f"{role}_num_nodes"), getattr(res, f"{role}_num_gpus_per_node")
        flags = f"--{role}_num_nodes {nodes} --{role}_num_gpus_per_node {gpus}"
        if nodes < 0 or gpus < 0:
            raise UserError(f"{flags}: device counts must be >= 0")
        if nodes * gpus == 0 and role_needed(cfg, role) and _colocated_host(cfg, role) is None:
            why = {"critic": "--advantage_estimator gae trains a critic",
                   "ref": "the KL term (--init_kl_coef > 0 or --use_kl_loss) needs the reference model",
                   "reward": "--reward_pretrain names a reward model",
                   "teacher": "--teacher_pretrain names a distillation teacher"}[role]
            raise UserError(f"{flags}: the {role} role has no devices but {why}; give it devices or colocate it "
                            f"with the actor (--colocate_all_models"
                            f"{', --colocate_actor_ref' if role in FROZEN_ON_ACTOR else ''}"
                            f"{', --colocate_critic_reward' if role == 'reward' else ''})")
    if r.vllm_num_engines < 0:
        raise UserError(f"--vllm_num_engines must be >= 0 (got {r.vllm_num_engines})")
    check_positive({"vllm_tensor_parallel_size": r.vllm_tensor_parallel_size})
    if not 0 < r.vllm_gpu_memory_utilization <= 1:
        raise UserError(f"--vllm_gpu_memory_utilization must be in (0, 1] (got {r.vllm_gpu_memory_utilization})")
    if res.colocate_all_models and r.vllm_num_engines > 0:
        actor = res.actor_num_nodes * res.actor_num_gpus_per_node
        engines = r.vllm_num_engines * r.vllm_tensor_parallel_size
        if actor != engines:
            raise UserError(f"--colocate_all_models needs actor devices (--actor_num_nodes x "
                            f"--actor_num_gpus_per_node = {actor}) == --vllm_num_engines x "
                            f"--vllm_tensor_parallel_size (= {engines})")


def validate_placement(cfg: RLFlags) -> None:
    """The placement's flag rules (after the batch rules): a colocated role fits on its host's devices, and every
    role splits a step's samples and the train batch evenly over its own ranks (each role's DeepSpeed config splits
    the train batch over its ranks)."""
    res, s = cfg.resources, cfg.strategy
    devices = {role: role_ranks(cfg, role) for role in ROLES if role_needed(cfg, role)}  # one device per rank
    shares: list[tuple[str, str, tuple[str, ...]]] = []
    if res.colocate_all_models:
        shares.append(("--colocate_all_models", "actor", ("ref", "critic", "reward", "teacher")))
    if not res.colocate_all_models and res.colocate_actor_ref:
        shares.append(("--colocate_actor_ref", "actor", FROZEN_ON_ACTOR))
    if not res.colocate_all_models and res.colocate_critic_reward and "critic" in devices:
        shares.append(("--colocate_critic_reward", "critic", ("reward",)))
    for why, owner, guests in shares:
        for guest in (g for g in guests if g in devices and devices[g] > devices[owner]):
            raise UserError(f"{why}: {guest} needs {devices[guest]} devices but the {owner} has {devices[owner]}; "
                            f"give the {guest} at most as many (--{guest}_num_nodes x --{guest}_num_gpus_per_node)")
    samples = cfg.rollout.rollout_batch_size * cfg.rollout.n_samples_per_prompt
    for role, devices_of_role in devices.items():
        ranks = devices_of_role // s.ring_attn_size  # data-parallel: a sequence-parallel group shares its samples
        flags = f"--{role}_num_nodes x --{role}_num_gpus_per_node" + (
            f" / --ring_attn_size {s.ring_attn_size}" if s.ring_attn_size > 1 else "")
        if samples % ranks:
            raise UserError(f"{samples} samples per step (--rollout_batch_size x --n_samples_per_prompt) do not "
                            f"split evenly over the {ranks} {role} ranks ({flags}); use a multiple of {ranks}")
        check_batch_split(s.train_batch_size, s.micro_train_batch_size, ranks, f"{role} ranks ({flags})")
