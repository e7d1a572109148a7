"""The memory planner behind `--dry_run`: per-device memory of every role of a run, before anything is allocated.

`build_plan(cfg, trainer, devices)` reads the model's config.json (no weights), the placement and the flags, and
returns a `Plan`: one `Pool` per group of devices that roles share (the placement of `rlhfkit/distributed/
placement.py`; a single-process trainer is one pool), each with rows (role, component, phase, bytes per device).
The byte counts come from `rlhfkit/planner/memory.py` (ZeRO arithmetic, activations, KV cache; a VLM: vision.py);
the rollout engines' rows from engine_rows.py (a Transformers engine that runs in the actor holds no weights of its
own); the plan's data types are in rows.py.

Phases, for roles that take turns on shared devices (the hybrid engine):
- resident: held the whole run;
- generate: only while the engines generate (`--vllm_enable_sleep` frees vLLM's otherwise; KV caches);
- train: only while the DeepSpeed roles score and train (`--deepspeed_enable_sleep` offloads them during
  generation; it also offloads each role while another one runs, so one role's states are on the device at once).
A pool's peak is resident + max(generate, train); in the train phase activations are transient (one micro-batch
of one role at a time), so they add as a maximum, not a sum.

On a machine without GPUs (and no `--dry_run_gpu_memory_gb`) the device is the host: each process also holds the
Python + torch + transformers baseline (`CPU_PROCESS_BASELINE`), and the run's processes share the host's memory.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import replace

from rlhfkit.config.backend import layout_name
from rlhfkit.config.critic_optim import critic_strategy
from rlhfkit.config.kinds import OfflineConfig, TrainConfig, WithReference
from rlhfkit.config.rl import PPOConfig, needs_critic, needs_reference, role_needed, role_ranks
from rlhfkit.config.rl_specs import placement_spec
from rlhfkit.config.sequence_parallel import check_ring_heads, check_ring_world
from rlhfkit.distributed.placement import plan_pools, role_demands
from rlhfkit.errors import UserError
from rlhfkit.planner import memory as mem
from rlhfkit.planner import parallel as par
from rlhfkit.planner import vision
from rlhfkit.planner.engine_rows import IN_ACTOR, engine_member, engine_rows
from rlhfkit.planner.rows import Devices, Plan, Pool, Row

# Resident set of one trainer process on CPU before its models count: the interpreter, torch, transformers, datasets,
# tokenizers and DeepSpeed imported, the tokenizer and the data loaded. Measured 2026-11-28 on a 2-core CPU machine
# (AMD EPYC Zen 3, torch 2.13.0+cpu, transformers 5.19), after Triton and PEFT left these processes
# (rlhfkit/models/triton_guard.py, rlhfkit/algorithms/lr_schedule.py; 515 MiB before): the peak RSS (getrusage
# RUSAGE_CHILDREN ru_maxrss) of train_sft, train_dpo and train_ppo on the 1M-parameter demo model was 433, 438 and
# 429 MiB; minus this planner's model terms for those runs (16-32 MiB) that leaves 405-415 MiB.
# tests/planner/test_plan_measured.py checks the whole estimate against the demo model and a 27M-parameter Llama.
CPU_PROCESS_BASELINE = 410 * mem.MIB
# The local Ray cluster of a train_ppo_ray run on one machine (GCS, raylet, dashboard, workers' core): about 0.5 GB
# after ray.init (Ray 2.60, measured on the CPU dev machine 2026-11-22).
RAY_LOCAL_CLUSTER = 512 * mem.MIB
# Below this share of a device left free the plan still fits but says so: allocator fragmentation and the CUDA
# context (about 0.5-1 GiB per process on a GPU) are not in the rows.
TIGHT_FRACTION = 0.9


def _shape(path: str | None, flag: str) -> mem.ModelShape:
    if not path:
        raise UserError(f"--dry_run needs {flag}: a local model directory with a config.json")
    return mem.read_model_shape(path, flag)


def _trained_rows(role: str, shape: mem.ModelShape, cfg: TrainConfig, ranks: int, phase: str, *, lm_head: bool = True,
                  lora_rank: int = 0) -> list[Row]:
    m = cfg.model
    s = critic_strategy(cfg.strategy, cfg.critic_optim) if isinstance(cfg, PPOConfig) and role == "critic" \
        else cfg.strategy
    if s.backend == "fsdp2":
        return _fsdp2_rows(role, shape, cfg, _layout(cfg, ranks), phase, lm_head=lm_head, lora_rank=lora_rank,
                           offload=s.adam_offload)
    params = shape.params(lm_head)
    trainable = shape.lora_params(lora_rank) + (0 if lm_head else shape.hidden_size + 1) if lora_rank else params
    muon = (shape.lora_params(lora_rank) if lora_rank else shape.hidden_matrix_params()) if s.optim == "muon" else 0
    st = mem.trained_states(params, trainable, m.bf16, s.zero_stage, ranks, s.adam_offload, muon)
    weights_note = f"{params / 1e9:.3f}B x {'2 (bf16)' if m.bf16 else '4'}"
    if m.load_in_4bit and lora_rank:  # QLoRA: NF4 base weights, not partitioned
        st = replace(st, weights=mem.qlora_weights(params, trainable))
        weights_note = f"{params / 1e9:.3f}B in NF4 (--load_in_4bit) + LoRA in bf16"
    what = f"ZeRO-{s.zero_stage} over {ranks}" if ranks > 1 else f"ZeRO-{s.zero_stage}"
    rows = [Row(role, "weights", phase, st.weights,
                note=weights_note + (f", {what}" if s.zero_stage >= 3 and not m.load_in_4bit else "")),
            Row(role, "gradients", phase, st.gradients, note=("LoRA only, " if lora_rank else "") + what),
            Row(role, "optimizer states", phase, st.optimizer,
                note=(f"Muon 4 B/matrix param, AdamW 8 B/other param, {what}" if muon else
                      f"Adam {'12' if m.bf16 else '8'} B/param, {what}") + (", offloaded" if s.adam_offload else ""))]
    if st.optimizer_host:
        rows.append(Row(role, "optimizer states (host RAM)", "host", st.optimizer_host, note="--adam_offload"))
    return rows


def _layout(cfg: TrainConfig, ranks: int) -> par.Layout:
    s = cfg.strategy
    return par.Layout(s.backend, ranks, s.ring_attn_size, s.ds_tensor_parallel_size)


def _fsdp2_rows(role: str, shape: mem.ModelShape, cfg: TrainConfig, layout: par.Layout, phase: str, *,
                lm_head: bool, lora_rank: int = 0, offload: bool = False, trained: bool = True) -> list[Row]:
    """A model's rows on FSDP2 (`rlhfkit/planner/parallel.py`): fp32 shards (load dtype when frozen), and the
    parameters gathered while a unit runs."""
    lora = shape.lora_params(lora_rank) if lora_rank else 0
    st = par.fsdp2_states(shape, layout, cfg.model.bf16, trained=trained, lora=lora, lm_head=lm_head,
                          offload=offload)
    where = f"FSDP2 over {layout.shard_ranks}" + (f", TP {layout.tp}" if layout.tp > 1 else "")
    home, moved = ("host", ", offloaded (CPUOffloadPolicy)") if st.host else (phase, "")
    rows = [Row(role, "weights", home, st.weights, note=f"{'fp32' if trained else 'frozen'} shards, {where}{moved}")]
    if trained:
        rows += [Row(role, "gradients", home, st.gradients, note=("LoRA only, " if lora else "") + f"fp32, {where}"),
                 Row(role, "optimizer states", home, st.optimizer, note=f"AdamW 8 B/param, {where}" + moved)]
    rows.append(Row(role, "gathered parameters", "train" if phase == "resident" else phase, st.gathered,
                    note="root unit + layers being run, compute dtype" + (" + their gradients" if trained else "")))
    return rows


def _frozen_rows(role: str, shape: mem.ModelShape, cfg: TrainConfig, ranks: int, phase: str, *, lm_head: bool = True,
                 offload: bool = False) -> list[Row]:
    if cfg.strategy.backend == "fsdp2" and not offload:
        return _fsdp2_rows(role, shape, cfg, _layout(cfg, ranks), phase, lm_head=lm_head, trained=False)
    w = mem.frozen_weights(shape.params(lm_head), cfg.model.bf16, cfg.strategy.zero_stage, ranks)
    if offload:
        return [Row(role, "weights (offloaded)", "host", w, note="kept on the host between uses")]
    return [Row(role, "weights", phase, w, note="frozen" + (f", ZeRO-3 over {ranks}" if cfg.strategy.zero_stage >= 3
                                                              and ranks > 1 else ""))]


def _act_row(role: str, shape: mem.ModelShape, cfg: TrainConfig, rows: int, seq: int, *, train: bool,
             lm_head: bool = True) -> Row:
    m = cfg.model
    eager = m.attn_implementation == "eager" and not m.flash_attn
    layout = _layout(cfg, 1)
    if layout.sp > 1 or layout.tp > 1:
        return _parallel_act_row(role, shape, cfg, rows, seq, layout, train=train, lm_head=lm_head)
    if train:
        b = mem.train_activations(shape, rows, seq, m.bf16, m.gradient_checkpointing, eager, lm_head)
        note = f"{rows} x {seq} tokens" + (", checkpointed" if m.gradient_checkpointing else "")
    else:
        b = mem.forward_activations(shape, rows, seq, m.bf16, lm_head)
        note = f"forward, {rows} x {seq} tokens"
    return Row(role, "activations", "train", b, transient=True, note=note)


def _parallel_act_row(role: str, shape: mem.ModelShape, cfg: TrainConfig, rows: int, seq: int, layout: par.Layout,
                      *, train: bool, lm_head: bool) -> Row:
    """Activations on one rank of a sequence- or tensor-parallel layout (`rlhfkit/planner/parallel.py`)."""
    m, ckpt = cfg.model, cfg.model.gradient_checkpointing and train
    b = par.parallel_activations(shape, rows, seq, m.bf16, ckpt, layout, train=train, lm_head=lm_head)
    note = ("" if train else "forward, ") + f"{rows} x {seq} tokens" + (f" / ring {layout.sp}" if layout.sp > 1
                                                                      else f", projections / TP {layout.tp}")
    return Row(role, "activations", "train", b, transient=True, note=note)


def _plan_preference(cfg: OfflineConfig, trainer: str, ranks: int) -> list[Pool]:
    """sft, rm, dpo, kto: one process per device, data parallel over `ranks`."""
    shape = _shape(cfg.model.pretrain, "--pretrain")
    check_ring_world(cfg.strategy.ring_attn_size, ranks)
    check_ring_heads(cfg.strategy.ring_attn_size, shape.num_heads)
    micro, seq = cfg.strategy.micro_train_batch_size, cfg.data.max_len
    reward_model = trainer == "rm"
    rows = _trained_rows("model", shape, cfg, ranks, "resident", lm_head=not reward_model,
                         lora_rank=cfg.model.lora_rank)
    pair_rows = micro if trainer == "sft" else 2 * micro  # chosen + rejected (KTO: samples + KL pairs)
    rows.append(_act_row("model", shape, cfg, pair_rows, seq, train=True, lm_head=not reward_model))
    if isinstance(cfg, WithReference):
        ref_path = cfg.reference.ref_pretrain or cfg.model.pretrain
        ref = _shape(ref_path, "--ref_pretrain") if cfg.reference.ref_pretrain else shape
        rows += _frozen_rows("reference", ref, cfg, ranks, "resident", offload=cfg.reference.ref_offload)
        rows.append(_act_row("reference", ref, cfg, pair_rows, seq, train=False))
    if cfg.model.lora_rank:
        rows[0].note += f" (frozen base; LoRA rank {cfg.model.lora_rank})"
    return [Pool(trainer, ranks, ["model"], rows)]


def _rl_role_rows(cfg: PPOConfig, role: str, ranks: int, shapes: dict[str, mem.ModelShape], turns: bool) -> list[Row]:
    """Rows of one RL role on one device of its pool."""
    d, r = cfg.data, cfg.rollout
    seq = d.prompt_max_len + d.generate_max_len
    phase = "train" if turns else "resident"
    offload = cfg.resources.ref_reward_offload
    if role == "actor":
        return _trained_rows("actor", shapes["actor"], cfg, ranks, phase, lora_rank=cfg.model.lora_rank) + [
            _act_row("actor", shapes["actor"], cfg, cfg.strategy.micro_train_batch_size, seq, train=True)]
    if role == "critic":
        return _trained_rows("critic", shapes["critic"], cfg, ranks, phase, lm_head=False) + [
            _act_row("critic", shapes["critic"], cfg, cfg.strategy.micro_train_batch_size, seq, train=True,
                     lm_head=False)]
    lm_head = role == "ref"
    return [*_frozen_rows(role, shapes[role], cfg, ranks, phase, lm_head=lm_head, offload=offload),
            _act_row(role, shapes[role], cfg, r.micro_rollout_batch_size, seq, train=False, lm_head=lm_head)]


def _rl_shapes(cfg: PPOConfig) -> dict[str, mem.ModelShape]:
    actor = _shape(cfg.model.pretrain, "--pretrain")
    m = cfg.rl_model
    shapes = {"actor": actor, "ref": actor}
    if role_needed(cfg, "reward"):
        shapes["reward"] = _shape(m.reward_pretrain, "--reward_pretrain")
    if needs_critic(cfg):
        path = m.critic_pretrain or m.reward_pretrain
        shapes["critic"] = _shape(path, "--critic_pretrain") if path else actor
    return shapes


def _plan_rl(cfg: PPOConfig, trainer: str, devices: Devices) -> list[Pool]:
    shapes = _rl_shapes(cfg)
    res = cfg.resources
    if trainer == "ppo":  # one process: every role, and the Transformers engine, on one device
        pool = Pool("ppo", 1, [])
        roles = ["actor"] + [x for x, on in (("critic", needs_critic(cfg)), ("ref", needs_reference(cfg)),
                                              ("reward", role_needed(cfg, "reward"))) if on]
        for role in roles:
            pool.members.append(role)
            pool.rows += _rl_role_rows(cfg, role, 1, shapes, False)
        pool.members.append("hf_engine")  # its own copy of the policy (engine_rows.py)
        pool.rows += engine_rows(cfg, shapes["actor"], devices, "hf_engine", pool)
        return [pool]
    placement = placement_spec(cfg)
    demands = role_demands(placement)
    ranks = {d.name: d.ranks for d in demands}
    pools = []
    for p in plan_pools(demands, colocate_all=placement.colocate_all, colocate_actor_ref=placement.colocate_actor_ref,
                        colocate_critic_reward=placement.colocate_critic_reward):
        members = [engine_member(cfg, m) for m in p.members]  # the Transformers engine may run in the actor
        pool = Pool(p.name, p.bundles, members, turns=res.deepspeed_enable_sleep and len(p.members) > 1)
        for member in members:
            if member in ("vllm", "hf_engine", IN_ACTOR):
                pool.rows += engine_rows(cfg, shapes["actor"], devices, member, pool)
            else:
                pool.rows += _rl_role_rows(cfg, member, ranks[member], shapes, pool.turns)
        pools.append(pool)
    return pools


def _ranks_of(cfg: TrainConfig, trainer: str, role: str, world_size: int) -> int:
    """Processes holding a role's rows: its ranks (train_ppo_ray), the launcher's world size, or 1 (train_ppo)."""
    if trainer == "ppo":
        return 1
    if not isinstance(cfg, PPOConfig):
        return world_size
    if role == "vllm":
        return cfg.rollout.vllm_num_engines
    if role == IN_ACTOR:  # no process of its own: its rows are the actor's
        return 0
    return 1 if role == "hf_engine" else role_ranks(cfg, role)


def _to_host(pools: list[Pool], cfg: TrainConfig, trainer: str, world_size: int) -> None:
    """On the host every process (rank) holds the baseline and its own rows, sleeping and offloaded states
    included (they move to host memory, not away)."""
    for pool in pools:
        procs = sum(_ranks_of(cfg, trainer, m, world_size) for m in pool.members) if trainer == "ppo_ray" \
            else _ranks_of(cfg, trainer, "model", world_size)
        for row in pool.rows:
            row.phase = "train" if row.transient else "resident"
        if trainer == "ppo_ray":  # a process per rank of each role: the largest role's rank
            per_role: dict[str, float] = {}
            for row in pool.rows:
                per_role[row.role] = per_role.get(row.role, 0.0) + row.bytes
            pool.largest_process = CPU_PROCESS_BASELINE + max(per_role.values(), default=0.0)
        else:
            pool.largest_process = CPU_PROCESS_BASELINE + pool.peak
        for row in pool.rows:
            row.bytes *= _ranks_of(cfg, trainer, row.role, world_size) if trainer == "ppo_ray" else procs
        pool.rows.insert(0, Row("process", "Python + torch + transformers", "resident", CPU_PROCESS_BASELINE * procs,
                                note=f"{procs} process{'es' if procs > 1 else ''} x measured baseline"))
        pool.turns = False
    if trainer == "ppo_ray" and pools:
        pools[0].rows.insert(1, Row("ray", "local Ray cluster", "resident", RAY_LOCAL_CLUSTER, note="measured"))


def plan_pools_for(cfg: TrainConfig, trainer: str, devices: Devices, world_size: int = 1) -> list[Pool]:
    """The pools and their rows (see the module docstring)."""
    pools = _plan_rl(cfg, trainer, devices) if isinstance(cfg, PPOConfig) else _plan_preference(cfg, trainer,
                                                                                                 world_size)
    vision.add_vision_rows(pools, cfg, lambda role: _ranks_of(cfg, trainer, role, world_size))  # planner/vision.py
    if devices.kind == "cpu":
        if not isinstance(cfg, PPOConfig) and world_size > 1:  # rlhfkit/planner/parallel.py, HOST_LOAD_COPIES
            pools[0].rows.append(Row("model", "load and sharding copies", "resident", par.host_load_bytes(
                _shape(cfg.model.pretrain, "--pretrain"), cfg.model.bf16), note="measured, ranks of a launcher"))
        _to_host(pools, cfg, trainer, world_size)
    else:
        for pool in pools:
            for row in pool.rows:
                if row.phase == "host":
                    row.phase = "host RAM"  # listed, not counted against the device
    return pools


def build_plan(cfg: TrainConfig, trainer: str, devices: Devices, world_size: int = 1) -> Plan:
    """The plan of `trainer` (sft, rm, dpo, kto, ppo, ppo_ray) for `cfg` on `devices`; `world_size` is the
    data-parallel size of the launcher-run trainers (sft, rm, dpo, kto). Advice for a plan that does not fit:
    rlhfkit/planner/advice.py."""
    pools = plan_pools_for(cfg, trainer, devices, world_size)
    m = cfg.model
    shape = _shape(m.pretrain, "--pretrain")
    header = [f"model {m.pretrain}: {shape.params() / 1e9:.3f}B parameters ({shape.num_layers} layers, hidden "
              f"{shape.hidden_size}, vocab {shape.vocab_size}); {'bf16' if m.bf16 else 'fp32'}, "
              f"{layout_name(cfg.strategy)}{', --adam_offload' if cfg.strategy.adam_offload else ''}"
              f"{f', ring {cfg.strategy.ring_attn_size}' if cfg.strategy.ring_attn_size > 1 else ''}"
              f"{f', TP {cfg.strategy.ds_tensor_parallel_size}' if cfg.strategy.ds_tensor_parallel_size > 1 else ''}"
              f"{', --gradient_checkpointing' if m.gradient_checkpointing else ''}"
              f"{f', LoRA rank {m.lora_rank}' if m.lora_rank else ''}"] + vision.header_lines(cfg)
    return Plan(trainer, header, pools, devices, devices.memory)


def replan(cfg: TrainConfig, trainer: str, devices: Devices, world_size: int,
           change: Callable[[TrainConfig], None]) -> Plan:
    """The plan of a copy of `cfg` changed by `change(cfg_copy)` (for advice)."""
    changed = copy.deepcopy(cfg)
    change(changed)
    return build_plan(changed, trainer, devices, world_size)
