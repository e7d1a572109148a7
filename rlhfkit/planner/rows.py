"""The data of a `--dry_run` memory plan (`rlhfkit/planner/plan.py` builds it, `advice.py` prints it): the devices it
is measured against, the pools of devices that roles share, their rows (role, component, phase, bytes per device),
and how a pool's phases add up to its peak (see plan.py's docstring for the phases)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Devices:
    """What the plan is measured against: `count` devices of `memory` bytes each (GPUs) or the host (CPU)."""

    kind: str  # "gpu" or "cpu"
    memory: float
    count: int
    source: str  # where the numbers come from, for the header line


@dataclass
class Row:
    role: str
    component: str
    phase: str  # resident | generate | train
    bytes: float
    transient: bool = False  # activations: one role's micro-batch at a time
    note: str = ""


@dataclass
class Pool:
    name: str
    devices: int
    members: list[str]
    rows: list[Row] = field(default_factory=list)
    turns: bool = False  # --deepspeed_enable_sleep: roles take turns in the train phase
    checks: list[str] = field(default_factory=list)  # failed hard conditions (vLLM cannot start ...)
    largest_process: float = 0.0  # CPU plans: the peak of the pool's largest process (baseline included)

    def phase_bytes(self, phase: str) -> float:
        rows = [r for r in self.rows if r.phase == phase]
        if phase != "train" or not self.turns:
            fixed = sum(r.bytes for r in rows if not r.transient)
            return fixed + max((r.bytes for r in rows if r.transient), default=0.0)
        per_role: dict[str, float] = {}
        for r in rows:
            if not r.transient:
                per_role[r.role] = per_role.get(r.role, 0.0) + r.bytes
        for role in {r.role for r in rows}:  # one transient use at a time (the shared engine's KV cache, training)
            per_role[role] = per_role.get(role, 0.0) + max((r.bytes for r in rows if r.role == role and r.transient),
                                                           default=0.0)
        return max(per_role.values(), default=0.0)

    @property
    def peak(self) -> float:
        return self.phase_bytes("resident") + max(self.phase_bytes("generate"), self.phase_bytes("train"))


@dataclass
class Plan:
    trainer: str
    header: list[str]
    pools: list[Pool]
    devices: Devices
    capacity: float  # bytes the peak is compared with, per device (CPU: the host's memory for all processes)
    advice: list[str] = field(default_factory=list)

    def worst(self) -> Pool:
        return max(self.pools, key=lambda p: p.peak)

    def total(self) -> float:
        """CPU: every process shares the host, so the pools add up; GPU: each pool has its own devices."""
        return sum(p.peak for p in self.pools) if self.devices.kind == "cpu" else self.worst().peak

    @property
    def fits(self) -> bool:
        return self.total() <= self.capacity and not any(p.checks for p in self.pools)
