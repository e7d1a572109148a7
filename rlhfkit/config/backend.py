"""The rules of `--backend fsdp2`: which DeepSpeed flags and features it replaces or does not have yet.

FSDP2 always shards parameters, gradients and optimizer state over all ranks (ZeRO-3's layout), so a ZeRO stage
given with it means the user expects DeepSpeed; its checkpoints reshard by themselves (torch.distributed.checkpoint),
so DeepSpeed's universal form has no place. These rules read which flags the command gave (`given`), so they run
after parsing (`rlhfkit.config.base.parse_config_given`), once.
"""

from __future__ import annotations

from typing import Any

from rlhfkit.config.tensor_parallel import check_tensor_parallel, refuse_tensor_parallel_for_rl
from rlhfkit.errors import UserError

#: DeepSpeed-only StrategyArgs flags, refused with --backend fsdp2 when the command gives them
_DEEPSPEED_ONLY = {
    "zero_stage": "FSDP2 always shards parameters, gradients and optimizer state over all ranks, as ZeRO-3",
    "zpg": "ZeRO++ hierarchical partitioning is DeepSpeed's",
    "overlap_comm": "FSDP2 overlaps its gathers and reductions with compute by itself",
    "grad_accum_dtype": "FSDP2 accumulates gradients in the parameters' dtype (fp32 shards)",
}


def check_backend(cfg: Any, given: frozenset[str]) -> None:
    """Stop (UserError, one line) on a flag or feature that --backend fsdp2 does not take."""
    check_tensor_parallel(cfg)
    strategy = getattr(cfg, "strategy", None)
    if strategy is None or getattr(strategy, "backend", "deepspeed") != "fsdp2":
        return
    for flag, why in _DEEPSPEED_ONLY.items():
        if flag in given:
            raise UserError(f"--{flag} is a DeepSpeed flag and this run uses --backend fsdp2 ({why}); drop it")
    if strategy.optim == "muon":
        raise UserError("--optim muon is not supported with --backend fsdp2 (each rank holds row shards of a weight "
                        "matrix, which Muon cannot orthogonalise); use --optim adam, or DeepSpeed --zero_stage 0")
    checkpoint = getattr(cfg, "checkpoint", None)
    if getattr(checkpoint, "use_ds_universal_ckpt", False):
        raise UserError("--use_ds_universal_ckpt is DeepSpeed's; --backend fsdp2 checkpoints (torch.distributed."
                        "checkpoint) already resume at another world size: drop it")


def check_fsdp2_for_rl(cfg: Any) -> None:
    """The RL roles run on FSDP2 (actor and critic trained, reference and reward sharded for their forwards),
    except a LoRA actor: its engine weights are merged adapters, which would need the whole model on one rank; and
    without tensor parallelism on any backend (`refuse_tensor_parallel_for_rl`)."""
    refuse_tensor_parallel_for_rl(cfg.strategy)
    if cfg.strategy.backend == "fsdp2" and cfg.model.lora_rank > 0:
        raise UserError("--lora_rank is not supported with --backend fsdp2 for the RL roles yet (the adapters are "
                        "merged into full weights for the rollout engines); drop one of them")


def layout_name(strategy: Any) -> str:
    """How the start-up line names the training layout: "FSDP2" or "ZeRO-<stage>"."""
    return "FSDP2" if strategy.backend == "fsdp2" else f"ZeRO-{strategy.zero_stage}"
