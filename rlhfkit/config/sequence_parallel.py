"""The rules of --ring_attn_size / --ring_head_stride (sequence parallelism), each checked once.

rlhfkit's sequence parallelism is DeepSpeed-Ulysses (all-to-all over attention heads, see
`rlhfkit.models.sequence_parallel`): --ring_attn_size ranks share every sample, each holding a contiguous slice of
its tokens. OpenRLHF's flag names are kept so its commands parse; --ring_head_stride, a knob of ring-flash-attn's
ring (how many heads each ring step carries), has no meaning for an all-to-all: any value >= 1 is accepted and
changes nothing, so OpenRLHF's long-context commands (which pass 2) run unchanged.
"""

from __future__ import annotations

from typing import Any

from rlhfkit.errors import UserError

#: The trainers whose forward passes split a sample over the sequence-parallel group.
SP_TRAINERS = ("train_sft", "train_rm", "train_dpo", "train_ppo", "train_ppo_ray")


def check_ring_flags(size: int, head_stride: int) -> None:
    """Parse-time rules of the two flags on their own."""
    if size < 1:
        raise UserError(f"--ring_attn_size {size}: must be at least 1 (1 = no sequence parallelism)")
    if head_stride < 1:
        raise UserError(f"--ring_head_stride {head_stride}: must be at least 1 (it has no effect: rlhfkit's "
                        "sequence parallelism is Ulysses, whose all-to-all sends each rank whole heads, not a ring)")


def check_ring_world(size: int, world_size: int) -> int:
    """The data-parallel world (world / --ring_attn_size) once the launcher's world size is known."""
    if size > 1 and world_size % size:
        raise UserError(f"--ring_attn_size {size} does not divide the world size {world_size}: each group of "
                        f"{size} ranks shares one sample; launch a multiple of {size} processes")
    return world_size // size


def check_ring_heads(size: int, num_heads: int) -> None:
    """Ulysses gives each rank num_heads / size whole query heads (key/value heads are repeated when they do not
    divide), so the query heads must split evenly."""
    if size > 1 and num_heads % size:
        raise UserError(f"--ring_attn_size {size} does not divide the model's {num_heads} attention heads "
                        "(Ulysses sequence parallelism gives each rank whole heads); pick a divisor of "
                        f"{num_heads}")


def refuse_ring_attn(strategy: Any, command: str) -> None:
    """A trainer whose forward passes do not split samples yet stops on --ring_attn_size > 1."""
    if getattr(strategy, "ring_attn_size", 1) > 1:
        raise UserError(f"--ring_attn_size is not supported by {command} yet (sequence parallelism covers "
                        f"{', '.join(SP_TRAINERS)}); drop it")


def check_ring_combinations(strategy: Any, aux_loss_coef: float) -> None:
    """What a sequence-parallel SFT/DPO run cannot combine with."""
    if strategy.ring_attn_size <= 1:
        return
    if aux_loss_coef > 0:
        raise UserError("--aux_loss_coef with --ring_attn_size: the MoE router loss would be counted on each "
                        "rank's slice of a sample; drop one")
    if strategy.use_dynamic_batch:
        raise UserError("--use_dynamic_batch with --ring_attn_size is not supported yet (the token budget would "
                        "count whole samples, not each rank's slice); use --micro_train_batch_size")


def check_rl_ring(cfg: Any, role_ranks: dict[str, int]) -> None:
    """train_ppo / train_ppo_ray (`cfg` a PPOConfig; `role_ranks` the devices of each role the run has): every
    role's ranks form groups of --ring_attn_size (actor, critic, reference and reward model each split their
    samples' tokens over a group), and what the RL forwards do not split stops here."""
    size = cfg.strategy.ring_attn_size
    if size <= 1:
        return
    if cfg.distill.teacher_pretrain or cfg.distill.teacher_url:
        raise UserError("--ring_attn_size with on-policy distillation (--teacher_pretrain / --teacher_url) is not "
                        "supported yet: the distillation loss reads the actor's whole logits, which no rank of a "
                        "sequence-parallel group holds; drop one")
    if cfg.algo.aux_loss_coef > 0:
        raise UserError("--aux_loss_coef with --ring_attn_size: the MoE router loss would be counted on each "
                        "rank's slice of a sample; drop one")
    for role, ranks in role_ranks.items():
        if ranks % size:
            raise UserError(f"--ring_attn_size {size} does not divide the {ranks} {role} ranks (--{role}_num_nodes "
                            f"x --{role}_num_gpus_per_node): each group of {size} ranks of a role shares one "
                            f"sample; give every role a multiple of {size} devices")
