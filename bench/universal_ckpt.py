"""Peak RSS of a `--use_ds_universal_ckpt` save and load per rank, against what one rank may hold.

Issue 20 (acceptance 2): the universal path never holds more than one rank's shard plus one layer on any rank. A
torchrun child builds a DeepSpeed ZeRO-3 engine (fp32) on the ~25M-parameter Llama of `bench/common.py`, trains one
step (so the Adam moments exist), and measures each rank's resident memory around one call: the peak (VmHWM, reset
through /proc/self/clear_refs just before) minus the RSS just before. glibc is told to return freed large blocks at
once (MALLOC_MMAP_THRESHOLD_, malloc_trim) so the RSS follows what is really held. Each rank's allowance is its
shard (its ZeRO-3 partition of the fp32 weights and both Adam moments) plus one decoder layer of the same three.

Cases: save at world 2, then load that checkpoint at worlds 1, 2 and 4; with `--compare <commit>` the same save and
the world-2 load through that commit's universal.py (the former rank-0 gather), side by side.

    nice .venv/bin/python bench/universal_ckpt.py [--compare b9214e5]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from common import MARK, ROOT, build_models, child_env, load, machine, proc_status_bytes, versions

RESULT = ROOT / "bench" / "results" / "universal_ckpt.md"
MB = 1024**2


# -- child (one torchrun rank) -------------------------------------------------------------------------------------
def _measured(op) -> dict[str, float]:
    import gc

    import torch.distributed as dist

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    dist.barrier()
    before, file_before = proc_status_bytes("VmRSS"), proc_status_bytes("RssFile")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    op()
    peak = proc_status_bytes("VmHWM")
    dist.barrier()
    return {"before_mb": before / MB, "peak_delta_mb": (peak - before) / MB,
            "file_mb": (proc_status_bytes("RssFile") - file_before) / MB}


def _allowance(engine) -> dict[str, float]:
    """This rank's shard and the largest decoder layer, fp32 weight + 2 Adam moments, in MB."""
    shard = sum(p.ds_tensor.numel() for p in engine.module.parameters() if p.requires_grad)
    layers = engine.module.model.layers
    layer = max(sum(p.ds_numel for p in layer.parameters()) for layer in layers)
    total = sum(p.ds_numel for p in engine.module.parameters() if p.requires_grad)
    return {"shard_mb": 12 * shard / MB, "layer_mb": 12 * layer / MB, "full_state_mb": 12 * total / MB}


def _engine(model_dir: str):
    import torch
    from transformers import AutoModelForCausalLM

    from rlhfkit.config.common import StrategyArgs
    from rlhfkit.distributed.strategy import DeepSpeedStrategy

    world = int(os.environ["WORLD_SIZE"])
    strategy = DeepSpeedStrategy(StrategyArgs(zero_stage=3, train_batch_size=2 * world, micro_train_batch_size=2,
                                              lr_warmup_ratio=0.0))
    strategy.setup_distributed()
    engine = strategy.prepare_train(AutoModelForCausalLM.from_pretrained(model_dir), 1e-4, 10)
    tokens = torch.randint(0, 1000, (2, 64), generator=torch.Generator().manual_seed(strategy.rank))
    loss = engine(input_ids=tokens, labels=tokens).loss
    engine.backward(loss)
    engine.step()
    return engine


def child(args: argparse.Namespace) -> None:
    import importlib.util

    import torch.distributed as dist

    spec = importlib.util.spec_from_file_location("universal_impl", args.impl)
    impl = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(impl)  # type: ignore[union-attr]
    engine = _engine(args.model_dir)
    rank0 = dist.get_rank() == 0
    if args.op == "save":
        result = _measured(lambda: impl.save_engine_state(engine, args.ckpt, "model", True, rank0))
    else:
        result = _measured(lambda: impl.load_engine_state(engine, args.ckpt, "model"))
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, {**result, **_allowance(engine)})
    if rank0:
        print(MARK + json.dumps(rows), flush=True)


# -- parent --------------------------------------------------------------------------------------------------------
def run(model_dir: Path, impl: Path, op: str, world: int, ckpt: Path) -> list[dict]:
    from rlhfkit.distributed.launch import free_port

    env = {**child_env("rlhfkit", 1), "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world), "--master_addr",
           "127.0.0.1", "--master_port", str(free_port()), __file__, "--child", "--op", op, "--impl", str(impl),
           "--model_dir", str(model_dir), "--ckpt", str(ckpt)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=1200)
    lines = [x for x in proc.stdout.splitlines() if x.startswith(MARK)]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"{op} at world {world} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len(MARK):])


def rows_for(label: str, op: str, world: int, ranks: list[dict]) -> list[str]:
    out = []
    for r, x in enumerate(ranks):
        budget = x["shard_mb"] + x["layer_mb"]
        out.append(f"| {label} | {op} | {world} | {r} | {x['peak_delta_mb']:.1f} | {x['shard_mb']:.1f} | "
                   f"{x['layer_mb']:.1f} | {x['full_state_mb']:.1f} | "
                   f"{'yes' if x['peak_delta_mb'] <= budget else 'NO'} |")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", action="store_true")
    parser.add_argument("--op"), parser.add_argument("--impl"), parser.add_argument("--model_dir")
    parser.add_argument("--ckpt")
    parser.add_argument("--compare", help="a commit whose rlhfkit/distributed/universal.py runs side by side")
    args = parser.parse_args()
    if args.child:
        return child(args)
    start_load = load()
    work = Path(tempfile.mkdtemp(prefix="universal_bench_"))
    _, models = build_models(work / "models")
    impls = {"sharded (this tree)": ROOT / "rlhfkit" / "distributed" / "universal.py"}
    if args.compare:
        old = work / "universal_old.py"
        old.write_text(subprocess.run(["git", "show", f"{args.compare}:rlhfkit/distributed/universal.py"],
                                      capture_output=True, text=True, check=True, cwd=ROOT).stdout)
        impls[f"rank-0 gather ({args.compare})"] = old
    lines = []
    for label, impl in impls.items():
        ckpt = work / label.split()[0]
        lines += rows_for(label, "save", 2, run(models["25m"], impl, "save", 2, ckpt))
        for world in (1, 2, 4) if impl == impls["sharded (this tree)"] else (2,):
            lines += rows_for(label, "load", world, run(models["25m"], impl, "load", world, ckpt))
        print("\n".join(lines), flush=True)
    write(lines, start_load)


def write(lines: list[str], start_load: str) -> None:
    import datetime

    head = ["# Universal checkpoint: peak RSS per rank of a save and a load", "",
            f"{datetime.date.today()}, {machine()}, {versions()}; load average at start {start_load}, at end "
            f"{load()}. `bench/universal_ckpt.py`: DeepSpeed ZeRO-3, fp32, the ~25M-parameter Llama of "
            "bench/common.py, one training step, then one save (world 2) or load (of that world-2 save) per torchrun "
            "run. Peak delta: VmHWM during the call minus VmRSS just before (MB). Allowance: the rank's shard (its "
            "ZeRO-3 partition of fp32 weights + 2 Adam moments) plus one decoder layer of the same.", "",
            "| implementation | op | world | rank | peak delta MB | shard MB | one layer MB | full state MB | "
            "within shard + layer |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |", *lines, ""]
    RESULT.write_text("\n".join(head))
    print(f"wrote {RESULT}")


if __name__ == "__main__":
    main()
