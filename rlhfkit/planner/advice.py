"""What `--dry_run` prints: the plan as a table per pool of devices, a verdict line, and, when the run does not fit,
the flag changes that would make it fit, each with the peak it leads to (computed by planning the changed config,
not guessed)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rlhfkit.config.kinds import TrainConfig, WithReference
from rlhfkit.config.rl import PPOConfig
from rlhfkit.planner.memory import gib
from rlhfkit.planner.plan import TIGHT_FRACTION, Devices, Plan, Pool, build_plan, replan

Change = Callable[[TrainConfig], None]


def _set(section: str, name: str, value: Any) -> Change:
    def change(cfg: TrainConfig) -> None:
        setattr(getattr(cfg, section), name, value)
    return change


def _scale_devices(factor: int) -> Change:
    def change(cfg: TrainConfig) -> None:
        if not isinstance(cfg, PPOConfig):
            return
        res = cfg.resources
        for role in ("actor", "critic", "ref", "reward"):
            gpus = getattr(res, f"{role}_num_gpus_per_node")
            setattr(res, f"{role}_num_gpus_per_node", gpus * factor)
        if res.colocate_all_models and cfg.rollout.vllm_num_engines:
            cfg.rollout.vllm_num_engines *= factor
    return change


def _together(changes: list[Change]) -> Change:
    """One change that applies `changes` in order (a copy of the list: the caller keeps appending)."""
    kept = tuple(changes)

    def change(cfg: TrainConfig) -> None:
        for one in kept:
            one(cfg)
    return change


def _ring_candidates(cfg: TrainConfig, devices: Devices, world_size: int) -> list[tuple[str, Change, int]]:
    """Larger --ring_attn_size (sequence parallelism: each rank holds 1/size of every sample's activations), on
    the ranks there are or, planning for GPUs, on as many GPUs as the ring needs (a size the model's heads do not
    split is refused by the replanning, so not advised)."""
    s = cfg.strategy
    if s.ds_tensor_parallel_size > 1:  # sequence and tensor parallelism do not combine yet
        return []
    out: list[tuple[str, Change, int]] = []
    for size in (2, 4, 8, 16):
        if size <= s.ring_attn_size:
            continue
        change = _set("strategy", "ring_attn_size", size)
        if world_size % size == 0:
            out.append((f"--ring_attn_size {size}", change, world_size))
        elif devices.kind == "gpu" and size > world_size:
            out.append((f"{size} GPUs with --ring_attn_size {size} (--dry_run_num_gpus {size} to plan it)", change,
                        size))
    return out


def _rl_ring_candidates(cfg: PPOConfig, world_size: int) -> list[tuple[str, Change, int]]:
    """train_ppo_ray: a larger --ring_attn_size that divides every role's devices and the policy's heads (each role's
    rank then holds 1/size of a sample's activations; the rollout engines are unchanged)."""
    from rlhfkit.config.rl_resources import ROLES, role_needed, role_ranks
    from rlhfkit.planner.memory import read_model_shape

    if cfg.strategy.ds_tensor_parallel_size > 1 or not cfg.model.pretrain:
        return []
    ranks = [role_ranks(cfg, role) for role in ROLES if role_needed(cfg, role)]
    heads = read_model_shape(cfg.model.pretrain, "--pretrain").num_heads
    return [(f"--ring_attn_size {size}", _set("strategy", "ring_attn_size", size), world_size)
            for size in (2, 4, 8, 16) if size > cfg.strategy.ring_attn_size and heads % size == 0
            and all(r % size == 0 for r in ranks)]


def _candidates(cfg: TrainConfig, trainer: str, devices: Devices, world_size: int) -> list[tuple[str, Change, int]]:
    """(flag text, change, world size after it) for every change that could lower the peak, cheapest first."""
    m, s = cfg.model, cfg.strategy
    out: list[tuple[str, Change, int]] = []
    if not m.gradient_checkpointing:
        out.append(("--gradient_checkpointing", _set("model", "gradient_checkpointing", True), world_size))
    if s.micro_train_batch_size > 1:
        half = s.micro_train_batch_size // 2
        out.append((f"--micro_train_batch_size {half}", _set("strategy", "micro_train_batch_size", half), world_size))
    if not isinstance(cfg, PPOConfig):
        out += _ring_candidates(cfg, devices, world_size)
    elif trainer == "ppo_ray":
        out += _rl_ring_candidates(cfg, world_size)
    ranks = world_size if not isinstance(cfg, PPOConfig) else \
        cfg.resources.actor_num_nodes * cfg.resources.actor_num_gpus_per_node if trainer == "ppo_ray" else 1
    if s.zero_stage < 3 and ranks > 1:
        out.append(("--zero_stage 3", _set("strategy", "zero_stage", 3), world_size))
    if not s.adam_offload:
        out.append(("--adam_offload", _set("strategy", "adam_offload", True), world_size))
    if isinstance(cfg, WithReference) and not cfg.reference.ref_offload:
        out.append(("--ref_offload", _set("reference", "ref_offload", True), world_size))
    if isinstance(cfg, PPOConfig) and trainer == "ppo_ray":
        res, r = cfg.resources, cfg.rollout
        shared = res.colocate_all_models
        if shared and r.vllm_num_engines and not r.vllm_enable_sleep:
            out.append(("--vllm_enable_sleep", _set("rollout", "vllm_enable_sleep", True), world_size))
        if shared and not res.deepspeed_enable_sleep:
            out.append(("--deepspeed_enable_sleep", _set("resources", "deepspeed_enable_sleep", True), world_size))
        if not res.ref_reward_offload:
            out.append(("--ref_reward_offload", _set("resources", "ref_reward_offload", True), world_size))
        if r.vllm_num_engines and r.vllm_gpu_memory_utilization > 0.3:
            u = round(r.vllm_gpu_memory_utilization - 0.2, 2)
            out.append((f"--vllm_gpu_memory_utilization {u}", _set("rollout", "vllm_gpu_memory_utilization", u),
                        world_size))
        if devices.kind == "gpu":
            out.append(("twice the GPUs per role (--*_num_gpus_per_node x 2)", _scale_devices(2), world_size))
    elif trainer != "ppo" and devices.kind == "gpu":
        out.append((f"{2 * world_size} GPUs (--dry_run_num_gpus {2 * world_size} to plan it)", lambda _cfg: None,
                    2 * world_size))
    if not m.lora_rank and trainer != "rm":
        out.append(("--lora_rank 16 (train adapters instead of all weights)", _set("model", "lora_rank", 16),
                    world_size))
    return out


def advise(cfg: TrainConfig, trainer: str, devices: Devices, world_size: int, plan: Plan) -> list[str]:
    """One line per change that lowers the peak, then the smallest combination (in order) that fits, if any."""
    before = plan.total()
    lines, kept = [], []
    for text, change, ws in _candidates(cfg, trainer, devices, world_size):
        try:
            after = replan(cfg, trainer, devices, ws, change)
        except Exception:  # noqa: BLE001 - a change the planner cannot express is simply not advised
            continue
        if after.total() < before * 0.995 or (after.fits and not plan.fits):
            verdict = "fits" if after.fits else "still too much"
            lines.append(f"{text}: peak {gib(before)} -> {gib(after.total())} ({verdict})")
            kept.append((text, change, ws))
    changes: list[Change] = []
    names: list[str] = []
    ws_all = world_size
    for text, change, ws in kept:
        changes.append(change)
        names.append(text)
        ws_all = max(ws_all, ws)
        combined = replan(cfg, trainer, devices, ws_all, _together(changes))
        if combined.fits:
            if len(names) > 1:
                lines.append(f"together: {' + '.join(names)}: peak {gib(combined.total())} (fits)")
            break
    else:
        if kept:
            lines.append("even all of the above together do not fit: plan for more or larger devices")
    return lines


def plan_with_advice(cfg: TrainConfig, trainer: str, devices: Devices, world_size: int = 1) -> Plan:
    """`build_plan`, with the advice attached when the plan does not fit."""
    plan = build_plan(cfg, trainer, devices, world_size)
    if not plan.fits:
        plan.advice = advise(cfg, trainer, devices, world_size, plan)
    return plan


def _pool_lines(pool: Pool, plan: Plan) -> list[str]:
    members = ", ".join(pool.members)
    turns = "; roles take turns (--deepspeed_enable_sleep)" if pool.turns else ""
    unit = "per device" if plan.devices.kind == "gpu" else "host"
    lines = [f"pool {pool.name}: {pool.devices} device{'s' if pool.devices > 1 else ''}, {members}{turns}",
             f"  {'role':<10} {'component':<30} {'phase':<9} {unit:>11}  note"]
    for r in pool.rows:
        lines.append(f"  {r.role:<10} {r.component:<30} {r.phase:<9} {gib(r.bytes):>11}  {r.note}")
    res, gen, train = pool.phase_bytes("resident"), pool.phase_bytes("generate"), pool.phase_bytes("train")
    cap = plan.capacity
    lines.append(f"  peak: resident {gib(res)} + max(generate {gib(gen)}, train {gib(train)}) = {gib(pool.peak)}"
                 + (f" of {gib(cap)} ({100 * pool.peak / cap:.0f}%)" if plan.devices.kind == "gpu" else ""))
    lines += [f"  problem: {c}" for c in pool.checks]
    return lines


def render(plan: Plan, prog: str) -> str:
    """The table, the verdict line and the advice."""
    d = plan.devices
    count = sum(p.devices for p in plan.pools) if plan.trainer == "ppo_ray" else d.count
    where = (f"{count} GPU{'s' if count != 1 else ''} of {gib(d.memory)} each ({d.source})" if d.kind == "gpu"
             else f"host memory {gib(d.memory)} ({d.source})")
    lines = [f"{prog} --dry_run: memory plan on {where}", *plan.header]
    for pool in plan.pools:
        lines += _pool_lines(pool, plan)
    total, cap = plan.total(), plan.capacity
    what = "largest per-device peak" if d.kind == "gpu" else "estimated peak of all processes"
    worst = f" (pool {plan.worst().name})" if d.kind == "gpu" and len(plan.pools) > 1 else ""
    if not plan.fits:
        verdict = "DOES NOT FIT"
    elif total > TIGHT_FRACTION * cap:
        verdict = "FITS, TIGHT (under 10% headroom)"
    else:
        verdict = "FITS"
    largest = max(p.largest_process for p in plan.pools)
    per_process = f"; the largest process peaks at {gib(largest)}" if d.kind == "cpu" and largest < total else ""
    lines.append(f"verdict: {verdict}: {what} {gib(total)} of {gib(cap)}{worst}{per_process}")
    if plan.advice:
        lines.append("to make it fit (each change alone, then the first combination that fits):")
        lines += [f"  {a}" for a in plan.advice]
    return "\n".join(lines)
