"""FSDP2 sleep/wake and CPU offload on a GPU (one process, NCCL): what `--deepspeed_enable_sleep` (OpenRLHF's
`--fsdp2_enable_sleep`) and `--adam_offload` (`--fsdp2_cpu_offload`) do to an FSDP2 engine where the shards live on
the device. On CPU-only machines the sleep path moves nothing, so only a GPU exercises it.

A tiny Llama (random init, fp32) is sharded by `rlhfkit.distributed.fsdp2_engine.shard_model` and trained 3 AdamW
steps by `FSDP2Engine`, four ways: plain; with `offload_states` / `reload_states` (rlhfkit.distributed.weight_sync)
around every step, as a Ray role worker calls them; with CPUOffloadPolicy; with both. Checked: asleep, no parameter
or AdamW moment of the engine is left on the GPU and the memory the CUDA allocator holds falls accordingly; awake,
they are back; the weight sync's tensors (`iter_full_parameters`, from CPU shards under offload) equal the
gathered state dict; the final weights equal the plain run's (bitwise for sleep, which only moves tensors; to 1e-6 for
CPU offload, whose AdamW steps on the CPU); under CPU offload the shards and moments stay in CPU memory and sleep
moves nothing. Prints one JSON line, `FSDP2_SLEEP {...}`, and exits 1 if a check fails.

    python bench/gpu/fsdp2_sleep.py     (on the GPU machine, from the repo root; about 20 s)
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def build(offload: bool):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlhfkit.distributed.fsdp2_engine import FSDP2Engine, shard_model

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    model = shard_model(LlamaForCausalLM(config), bf16=False, offload=offload)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return FSDP2Engine(model, optimizer, None, 1, 1.0, 4)


class Role:
    """What a Ray role worker hands to offload_states: an object holding the engine."""

    def __init__(self, engine):
        self.engine = engine


def devices(engine) -> dict[str, list[str]]:
    from torch.distributed.tensor import DTensor

    def where(t):
        return (t.to_local() if isinstance(t, DTensor) else t).device.type

    moments = [t for s in engine.optimizer.state.values() for t in s.values() if t.dim() > 0]
    return {"params": sorted({where(p) for p in engine.module.parameters()}),
            "moments": sorted({where(t) for t in moments})}


def run(sleep: bool, offload: bool) -> dict:
    import torch

    from rlhfkit.distributed import weight_sync

    engine = build(offload)
    role = Role(engine)
    ids = torch.randint(0, 512, (4, 64), generator=torch.Generator().manual_seed(1)).cuda()
    out: dict = {"asleep": [], "awake": [], "allocated_mib": []}
    for _ in range(3):
        if sleep:
            weight_sync.reload_states(role)
            out["awake"].append(devices(engine))
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        if sleep:
            before = torch.cuda.memory_allocated()
            weight_sync.offload_states(role)
            out["asleep"].append(devices(engine))
            out["allocated_mib"].append([round(before / 2**20, 2), round(torch.cuda.memory_allocated() / 2**20, 2)])
    if sleep:
        weight_sync.reload_states(role)
    out["weights"] = {k: v.cpu() for k, v in (engine.full_state_dict() or {}).items()}
    # what the weight sync sends the engines, one parameter at a time (from CPU shards under offload)
    out["synced"] = dict(weight_sync.iter_full_parameters(engine.module))
    out["moved_mib"] = round(weight_sync.SLEEP_STATS["moved"] / 2**20, 2)
    weight_sync.SLEEP_STATS.update(offloads=0, reloads=0, bytes=0, moved=0)
    return out


def main() -> int:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29533"), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")
    torch.cuda.set_device(0)
    dist.init_process_group("cpu:gloo,cuda:nccl")
    runs = {(s, o): run(s, o) for s in (False, True) for o in (False, True)}
    plain = runs[(False, False)]["weights"]
    report, ok = {}, True
    for (sleep, offload), r in runs.items():
        gap = max(float((r["weights"][k] - plain[k]).abs().max()) for k in plain)
        name = f"sleep={sleep},offload={offload}"
        report[name] = {"weight_gap": gap, "moved_mib": r["moved_mib"], "allocated_mib": r["allocated_mib"],
                        "asleep": r["asleep"][-1:] , "awake": r["awake"][-1:]}
        ok &= gap == 0.0 if not offload else gap < 1e-6
        synced = r["synced"]
        sync_gap = max(float((synced[k] - r["weights"][k]).abs().max()) for k in synced)
        report[name]["sync_gap"] = sync_gap
        ok &= synced.keys() == r["weights"].keys() and sync_gap == 0.0
        if sleep:
            home = "cpu" if offload else "cuda"
            ok &= all(d == {"params": ["cpu"], "moments": ["cpu"]} for d in r["asleep"])
            ok &= all(d["params"] == [home] and d["moments"] in ([home], []) for d in r["awake"])
            ok &= (r["moved_mib"] == 0) if offload else (r["moved_mib"] > 0)
            if not offload:  # the allocator holds less asleep than awake: the shards and moments left
                ok &= all(after < before for before, after in r["allocated_mib"])
    print("FSDP2_SLEEP " + json.dumps({"ok": ok, "device": torch.cuda.get_device_name(0),
                                       "torch": torch.__version__, **report}))
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
